"""Checkpoint directories in the Hugging Face layout, for every model family: the
``config.json`` reader's typed errors and field access (:mod:`.config_json`), safetensors
files and shards (:mod:`.safetensors_files`), and a small byte-level BPE tokenizer for
random checkpoints (:mod:`.text_tokenizer`). Model packages parse their own sections with
these; this package names no model."""
