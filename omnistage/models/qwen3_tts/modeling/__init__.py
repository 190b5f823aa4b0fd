"""Qwen3-TTS model code: config parsing, talker + code predictor, speaker encoder, prompt
construction, checkpoint loading and the unbatched reference generation loop."""
