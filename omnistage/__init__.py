"""omnistage: serve omni and speech models as pipelines of stages."""

__version__ = "0.1.0"
