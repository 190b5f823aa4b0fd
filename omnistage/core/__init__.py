"""What every layer shares; imports nothing else from omnistage.

- :mod:`.request`: request ids and finish reasons.
- :mod:`.errors`: the typed errors (the failure contract, HTTP status per class).
- :mod:`.messages`: the messages between stages and back to the coordinator (stage
  payload, stream chunk, stream done, abort, stage result / failure).
- :mod:`.payloads`: result types shared by stages and the server (:class:`AudioResult`).
- :mod:`.tombstones`: ids of requests that ended, so late messages never recreate state.
- :mod:`.lru`: the bounded least-recently-used map behind every content-keyed cache.

Layers import downward only: core <- config <- engine <- scheduling <- pipeline <-
serve / bench <- cli <- models (``tests/test_layering.py`` enforces it).
"""
