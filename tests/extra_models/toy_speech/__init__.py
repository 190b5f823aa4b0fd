"""A two-stage toy speech model that plugs into omnistage without touching the framework:
``score`` (text -> one tone per character) then ``synth`` (tones -> streamed 16 kHz PCM)."""
