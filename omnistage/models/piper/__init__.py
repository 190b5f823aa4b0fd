"""Piper (VITS exported to ONNX) text-to-speech voices."""
