"""Typed errors of omnistage: the failure contract.

Every failure a client can see is one of these classes; the HTTP layer maps them by type
(never by matching message strings):

=============================  ======  ==============================================
class                          HTTP    meaning
=============================  ======  ==============================================
``RequestValidationError``     400     bad input, detected before any model work
``AuthenticationError``        401     missing or wrong API key
``NotFoundError``              404     no such resource (model, saved voice) for this key
``ConflictError``              409     the resource exists already (a saved voice's name)
``UnsupportedMediaTypeError``  415     a body not declared as JSON, or compressed
``PayloadTooLargeError``       413     request body or media above its cap
``QueueFullError``             503     admission bound reached; retry later
``PipelineUnhealthyError``     503     a stage process died or the pipeline is stopping
``RequestTimeoutError``        504     the request's deadline passed
``StageFailureError``          500     a stage raised while computing the request
``RequestAbortedError``        499     the request was aborted (client gone, explicit)
``StreamBufferFullError``      499     aborted: its client stopped reading its stream
=============================  ======  ==============================================

``PipelineConfigError`` is raised at build time (never per request) and names the stage.
"""

from __future__ import annotations


def _rebuild(cls: type[OmnistageError], args: tuple, state: dict) -> OmnistageError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class OmnistageError(Exception):
    """Base of all omnistage errors. ``http_status`` is the status the server answers with.

    Errors cross process boundaries by pickle; :meth:`__reduce__` rebuilds any subclass
    from its message and attributes, whatever its ``__init__`` signature.
    """

    http_status: int = 500
    error_type: str = "server_error"

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))

    @property
    def public_message(self) -> str:
        """What a client is told (the error body's ``message``): the message itself, except
        where it carries internals (see :class:`StageFailureError`)."""
        return str(self)


class PipelineConfigError(OmnistageError):
    """A pipeline declaration is invalid; raised at build time.

    Args:
        message: what is wrong.
        stage: the stage the problem is located at, when there is one.
    """

    def __init__(self, message: str, stage: str | None = None) -> None:
        self.stage = stage
        super().__init__(f"stage {stage!r}: {message}" if stage else message)


class RequestValidationError(OmnistageError):
    """The request is invalid. ``param`` names the offending field (OpenAI ``param``)."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class PayloadTooLargeError(RequestValidationError):
    """A request body or an embedded media item exceeds its size or duration cap."""

    http_status = 413


class UnsupportedMediaTypeError(RequestValidationError):
    """The request body is not declared as JSON (``Content-Type: application/json``), or
    it is sent with a content coding (``Content-Encoding: gzip``, ...): bodies are never
    decompressed. ``coding`` names that coding (the answer then carries
    ``Accept-Encoding: identity``, RFC 7694); None for a media type.
    """

    http_status = 415

    def __init__(self, message: str, coding: str | None = None) -> None:
        self.coding = coding
        super().__init__(message)


class NotFoundError(RequestValidationError):
    """The named resource does not exist, or not for this API key."""

    http_status = 404
    error_type = "not_found_error"


class ConflictError(RequestValidationError):
    """The resource exists already (a saved voice of the same name)."""

    http_status = 409
    error_type = "conflict_error"


class AuthenticationError(OmnistageError):
    """Missing or wrong API key (``Authorization: Bearer <key>``)."""

    http_status = 401
    error_type = "authentication_error"


class QueueFullError(OmnistageError):
    """Admission refused: ``limit`` requests are already in flight."""

    http_status = 503
    error_type = "queue_full"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"server is at its limit of {limit} concurrent requests; retry later")


class PipelineUnhealthyError(OmnistageError):
    """The pipeline cannot serve: a stage process died, or it is starting or stopping.

    Args:
        message: why.
        retry_after_s: when a retry may succeed (a dead stage process is being restarted),
            seconds; the server sends it as ``Retry-After``.
    """

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class RequestTimeoutError(OmnistageError):
    """The request's deadline (seconds from admission) passed before it finished."""

    http_status = 504
    error_type = "timeout"


class StageFailureError(OmnistageError):
    """A stage failed while computing a request.

    ``str(error)`` holds the cause, for the log; a client sees only
    :attr:`public_message` (the stage and the request id, never internal exception text).

    Args:
        stage: name of the failing stage.
        cause: short description of the underlying exception (type and message).
        request_id: the failed request, once known (:meth:`for_request`).
    """

    http_status = 500
    error_type = "stage_failure"

    def __init__(self, stage: str, cause: str, request_id: str | None = None) -> None:
        self.stage = stage
        self.cause = cause
        self.request_id = request_id
        super().__init__(f"stage {stage!r} failed: {cause}")

    @property
    def public_message(self) -> str:
        request = f" for request {self.request_id}" if self.request_id else ""
        return f"stage {self.stage!r} failed{request}; the server log has the cause under that request id"

    def for_request(self, request_id: str) -> StageFailureError:
        """This failure, naming the request it ended."""
        return StageFailureError(self.stage, self.cause, request_id)


class RequestAbortedError(OmnistageError):
    """The request was aborted before it finished (client disconnect or explicit abort)."""

    http_status = 499
    error_type = "aborted"


class StreamBufferFullError(RequestAbortedError):
    """The request's client stopped reading its stream: its unread bytes passed the
    per-request cap, or it held the most when the global cap was reached. The request is
    aborted (499, finish_reason ``abort``) and its bytes released."""

    error_type = "stream_buffer_full"
