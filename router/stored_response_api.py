"""``GET /v1/responses/{response_id}``: a stored Responses answer, from the replica that holds it.

vLLM keeps a stored response (``store: true``, with VLLM_ENABLE_RESPONSES_API_STORE=1) in the
memory of the server that answered; the router remembers which replica that was
(``StoredResponses``) and asks it. A response the router has not seen (another router's, or from
before a restart) is asked of every replica in rotation at once, and the first that holds it
answers. The replica's answer is relayed as it is: its status, its JSON.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

import httpx
from aiohttp import web

from . import errors
from .auth import Auth
from .registry import ReplicaRegistry
from .stored_responses import StoredResponses

log = logging.getLogger(__name__)

PATH = "/v1/responses/{response_id}"


class StoredResponseLookup:
    def __init__(
        self,
        stored: StoredResponses,
        registry: ReplicaRegistry,
        auth: Auth,
        timeout_s: float,
    ) -> None:
        self.stored = stored
        self.registry = registry
        self.auth = auth
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def close(self) -> None:
        await self._client.aclose()

    async def handle_get(self, request: web.Request) -> web.StreamResponse:
        try:
            self.auth.check_client(request)
            response_id = request.match_info["response_id"]
            path = "/v1/responses/" + quote(response_id, safe="")
            if request.query_string:
                path += "?" + request.query_string
            replica = self.stored.replica_of(response_id)
            if replica is None:
                return await self._ask_everyone(response_id, path)
            if replica == "":
                raise _gone(
                    response_id, "was stored nowhere: its stream was resumed on another replica"
                )
            handle = self.registry.handles.get(replica)
            if handle is None:
                raise _gone(
                    response_id, f"is stored on replica {replica!r}, which has left the fleet"
                )
            answer = await self._get(handle.base_url + path)
            if answer is None:
                raise errors.upstream_unavailable(1)
            return _relayed(answer)
        except errors.ApiError as exc:
            return exc.response(errors.OPENAI)

    async def _ask_everyone(self, response_id: str, path: str) -> web.StreamResponse:
        everyone = list(self.registry.handles.values())
        handles = [h for h in everyone if h.state.healthy]
        if not handles:  # not "not found": nobody could be asked
            raise errors.no_healthy_replica(1)
        answers = await asyncio.gather(*(self._get(h.base_url + path) for h in handles))
        for handle, answer in zip(handles, answers, strict=True):
            if answer is not None and answer.status_code == 200:
                self.stored.remember(response_id, handle.name)
                return _relayed(answer)
        unheard = (
            len(everyone)
            - len(handles)
            + sum(answer is None or answer.status_code >= 500 for answer in answers)
        )
        if unheard:  # the one replica that holds it may be among those not heard from
            raise errors.ApiError(
                503,
                f"Response with id {errors.shown(response_id)} is on none of the replicas that "
                f"answered, and {unheard} could not be asked; try again shortly.",
                error_type="service_unavailable_error",
                param="response_id",
                code="response_lookup_incomplete",
                headers={"Retry-After": "1"},
            )
        raise errors.ApiError(
            404,
            f"Response with id {errors.shown(response_id)} not found on any replica.",
            param="response_id",
            code="response_not_found",
        )

    async def _get(self, url: str) -> httpx.Response | None:
        try:
            return await self._client.get(url)
        except (httpx.HTTPError, OSError) as exc:
            log.debug("GET %s failed: %s", url, exc)
            return None


def _relayed(answer: httpx.Response) -> web.Response:
    content_type = answer.headers.get("content-type", "application/json").split(";")[0]
    return web.Response(body=answer.content, status=answer.status_code, content_type=content_type)


def _gone(response_id: str, where: str) -> errors.ApiError:
    return errors.ApiError(
        404,
        f"The response {errors.shown(response_id)} {where}.",
        param="response_id",
        code="response_not_found",
    )
