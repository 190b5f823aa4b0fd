"""The ``omnistage`` command line: ``serve``, ``config resolve``, ``models``, ``bench``."""
