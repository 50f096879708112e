"""Which model serves a request: the `model` it names, through the server's pool (loaded on
demand when the server may load it), held for the whole response and released by
`LeaseMiddleware` once the response has ended (streamed answers included)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from localpaged.engine.model_pool import (
    Lease,
    LoadedModel,
    ModelBusyError,
    ModelLoadError,
    ModelTooLargeError,
    UnknownModelError,
)
from localpaged.server.errors import APIError
from localpaged.server.streams import ServerState

LEASES = "localpaged.leases"  # the scope key of a request's leases


class LeaseMiddleware:
    """Releases the models a request leased once its response is over."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Lease] = []
        scope[LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in leases:
                lease.release()


def loadable_name(state: ServerState, name: str) -> str | None:
    """The name the server loads `name` under (a registered model's, `:latest` dropped where
    the model has no tag), or None where it may not load it."""
    if state.loadable is None or not state.pool.can_load:
        return None
    names = set(state.loadable())
    if name in names:
        return name
    base = name.removesuffix(":latest")
    return base if base != name and base in names else None


def find_model(state: ServerState, name: str) -> LoadedModel | None:
    """The loaded model answering to `name` (not leased: for reading its details)."""
    return state.pool.find(name)


def known(state: ServerState, name: str) -> bool:
    """Whether `name` is loaded or the server may load it."""
    return find_model(state, name) is not None or loadable_name(state, name) is not None


def not_found(state: ServerState, name: str) -> APIError:
    """The 404 for a model this server neither has loaded nor may load."""
    if state.pool.can_load:
        hint = (f"it is not among the models pulled here; pull it first (`localpaged pull "
                f"{name}` or POST /api/pull)")
    else:
        loaded = ", ".join(repr(m.name) for m in state.pool.loaded()) or "none"
        hint = (f"this server has {loaded} loaded (start `localpaged serve {name}` to serve "
                "another)")
    return APIError(404, f"model {name!r} not found: {hint}", param="model",
                    code="model_not_found")


async def bind_model(request: Request, name: str, keep_alive: float | None = None
                     ) -> ServerState:
    """The server state bound to the model `name`, loaded first if needed; the model is held
    until the response ends. keep_alive: seconds it stays loaded once idle (None: its
    default). 404 for an unknown name, 400 for a model larger than the whole memory budget,
    503 when the models in use hold the memory it needs past the pool's wait, 500 when the
    load fails."""
    state: ServerState = request.app.state.localpaged
    loaded = find_model(state, name)  # the registry is read only for a model to load
    key = loaded.name if loaded is not None else loadable_name(state, name)
    if key is None:
        raise not_found(state, name)
    try:
        lease = await state.pool.acquire(key, keep_alive)
    except UnknownModelError:
        raise not_found(state, name) from None
    except ModelTooLargeError as exc:
        # 400, not 413 (that is about the request body) nor 507 (a 5xx): the request can
        # never succeed on this server as configured, whatever else is loaded, so retrying
        # it unchanged is pointless; the message says what would change that.
        raise APIError(400, str(exc), param="model", code="model_too_large") from exc
    except ModelBusyError as exc:
        # 503: the model fits the budget, only the requests running now hold the memory;
        # the same request can succeed later (OpenAI's clients retry a 503 themselves).
        raise APIError(503, str(exc), param="model", code="model_memory_busy") from exc
    except ModelLoadError as exc:
        raise APIError(500, str(exc), param="model", code="model_load_failed") from exc
    request.scope[LEASES].append(lease)
    return state.bind(lease.model)
