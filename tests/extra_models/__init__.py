"""Model packages outside ``omnistage.models``, laid out like it and loaded with
``OMNISTAGE_EXTRA_MODELS=tests.extra_models`` (see docs/adding_a_model.md)."""
