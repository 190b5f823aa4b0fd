"""A one-stage toy chat model that plugs into omnistage without touching the framework:
``reply`` streams the last user message's words back in reverse order (text only; it has
no talker, so it cannot speak)."""
