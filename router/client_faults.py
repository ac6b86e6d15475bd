"""Malformed requests are the client's fault: aiohttp answers them (400, 413, ...) and then logs
each at ERROR with a traceback, so any client can fill the router's log at will. This filter on
aiohttp's server logger keeps such a record at DEBUG, on one line, and lets everything else
through as it is. One raised out of a request handler is left alone: aiohttp answered that 500,
so it is the router's fault, not the client's."""

from __future__ import annotations

import logging
import traceback
from types import TracebackType

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from . import errors

_SERVER_LOGGER = "aiohttp.server"
# A request aiohttp could not parse or decode (bad headers, chunking, Content-Encoding), or a
# body that broke off: what the client sent, not a fault of the router.
CLIENT_FAULTS: tuple[type[BaseException], ...] = (HttpProcessingError, web.RequestPayloadError)


class ClientFaultFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, CLIENT_FAULTS) or _raised_in_a_handler(exc.__traceback__):
            return True
        logger = logging.getLogger(record.name)
        if not logger.isEnabledFor(logging.DEBUG):
            return False
        record.msg = f"{record.getMessage()}: {type(exc).__name__}: {' '.join(str(exc).split())}"
        record.args = None
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


def _raised_in_a_handler(tb: TracebackType | None) -> bool:
    # aiohttp runs every handler under RequestHandler._handle_request and answers 500 for what
    # escapes it; its parser's errors (400) are raised outside it.
    return any(frame.f_code.co_name == "_handle_request" for frame, _ in traceback.walk_tb(tb))


def quiet_client_faults() -> None:
    """Install the filter once (each router of a process calls this)."""
    logger = logging.getLogger(_SERVER_LOGGER)
    if not any(isinstance(f, ClientFaultFilter) for f in logger.filters):
        logger.addFilter(ClientFaultFilter())


def unreadable(exc: BaseException) -> errors.ApiError:
    """The 400 for a body the client sent broken (gzip that is not, a chunk cut short)."""
    # aiohttp's text is "400, message:\n  <why>": the why alone, on one line.
    why = str(exc).partition("message:")[2] or str(exc)
    return errors.bad_request(f"The request body cannot be read: {' '.join(why.split())}")


async def read_body(request: web.Request) -> bytes:
    """``request.read()``, with a broken body a 400 (``unreadable``), not an exception."""
    try:
        return await request.read()
    except CLIENT_FAULTS as exc:
        raise unreadable(exc) from None
