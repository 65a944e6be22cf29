"""The prefill role's bootstrap server (SGLang's rendezvous routes, radixd's KV hand-over),
and the bootstrap fields of a request.

SGLang's routes, as its ``CommonKVBootstrapServer`` answers them:

* ``PUT /route`` — a prefill rank registers (``attn_tp_size``, ``attn_tp_rank``,
  ``attn_cp_size``, ``attn_cp_rank``, ``attn_dp_size``, ``attn_dp_rank``, ``pp_size``,
  ``pp_rank``, ``system_dp_size``, ``system_dp_rank``, ``rank_ip``, ``rank_port``,
  ``page_size``, ``kv_cache_dtype``; ``prefill_http_port``): ``OK``.
* ``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=`` — all
  ``-1``: the prefill server's parallel sizes, page size and KV dtype; else that rank's
  ``rank_ip`` / ``rank_port``. 400 without the four, 503 until every rank registered, 404
  for a rank that did not.
* ``GET /health`` — ``OK``; ``POST /register_dp_rank`` / ``POST /query_dp_ranks`` — the
  data-parallel rank each bootstrap room went to.

radixd's hand-over, served at the registered rank's address (this server):

* ``POST /kv/register`` ``{"session_id", "layout"}`` — a decode instance's KV pool, by its
  transfer engine session (once per peer; again after a 404 from ``/kv/transfer``).
* ``POST /kv/transfer`` ``{"bootstrap_room", "session_id", "slots", "num_tokens"}`` — the
  slots it reserved for one request; answered as NDJSON: ``{"state": ...}`` each heartbeat
  interval (``KVPoll`` names) while the prefill side computes and writes, then one final
  line: ``success`` with ``first_token`` and ``bytes``, or ``failed`` with ``error``.
* ``POST /kv/abort`` ``{"bootstrap_room"}`` — the decode side gives up on a room: it fails,
  and the answer waits until no write into the decode side's slots is under way.

Contract: the routes run on the daemon's event loop; the rooms are ``disagg.PrefillRooms``'s.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from radixd.core.disagg import KVPoll, PoolLayout
from radixd.server.errors import ApiError

if TYPE_CHECKING:
    from radixd.server.disagg import PrefillRooms

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int
    room: int


def take_bootstrap(request, body: dict) -> None:
    """Move the bootstrap fields of a body read by a daemon in a PD role into the request's
    scope (``state["radixd"]["bootstrap"]``); null ones ask for nothing. Colocated daemons
    leave them to the routes, which refuse them."""
    st = request.app.state.radixd
    if st.disagg is None or not any(k in body for k in BOOTSTRAP_FIELDS):
        return
    host, port, room = (body.pop(k, None) for k in BOOTSTRAP_FIELDS)
    if host is None and port is None and room is None:
        return
    for key, value in zip(BOOTSTRAP_FIELDS, (host, port, room), strict=True):
        if isinstance(value, list):
            raise ApiError(400, f"'{key}': a batch is not served in a prefill/decode role; send one prompt",
                           param=key)
    if not isinstance(host, str) or not host:
        raise ApiError(400, "'bootstrap_host' must be the prefill instance's host", param="bootstrap_host")
    if port is None:
        port = st.settings.disaggregation.bootstrap_port
    for key, value in (("bootstrap_port", port), ("bootstrap_room", room)):
        if type(value) is not int or value < 0:
            raise ApiError(400, f"'{key}' must be a non-negative integer", param=key)
    request.scope["state"]["radixd"]["bootstrap"] = Bootstrap(host, port, room)


RANK_FIELDS = ("attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank",
               "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size",
               "kv_cache_dtype")
ROUTE_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class RankTable:
    """The registered prefill ranks, keyed (dp group, cp rank, tp rank, pp rank)."""

    def __init__(self) -> None:
        self.ranks: dict[tuple[int, int, int, int], dict] = {}
        self.info: dict | None = None  # the sizes, from the first registration
        self.room_dp: dict[int, int] = {}

    def register(self, d: dict) -> None:
        dp = int(d["attn_dp_rank"] if int(d["system_dp_size"]) == 1 else d["system_dp_rank"])
        self.ranks[(dp, int(d["attn_cp_rank"]), int(d["attn_tp_rank"]), int(d["pp_rank"]))] = {
            "rank_ip": d["rank_ip"], "rank_port": int(d["rank_port"])}
        if self.info is None:
            dp_size = int(d["attn_dp_size"] if int(d["system_dp_size"]) == 1 else d["system_dp_size"])
            self.info = {"attn_tp_size": int(d["attn_tp_size"]), "attn_cp_size": int(d["attn_cp_size"]),
                         "dp_size": dp_size, "pp_size": int(d["pp_size"]), "page_size": int(d["page_size"]),
                         "kv_cache_dtype": d["kv_cache_dtype"], "follow_bootstrap_room": True,
                         "enable_dsa_cache_layer_split": False, "prefill_http_port": d.get("prefill_http_port")}

    @property
    def ready(self) -> bool:
        i = self.info
        return i is not None and len(self.ranks) >= i["dp_size"] * i["attn_cp_size"] * i["attn_tp_size"] * i["pp_size"]


def build_bootstrap_app(table: RankTable, rooms: PrefillRooms) -> Starlette:
    async def route(request: Request) -> Response:
        if request.method == "PUT":
            try:
                data = await request.json()
                missing = [k for k in RANK_FIELDS if k not in data]
                if missing:
                    return PlainTextResponse(f"Missing fields: {', '.join(missing)}", status_code=400)
                table.register(data)
            except (ValueError, TypeError) as exc:
                return PlainTextResponse(f"Bad registration: {exc}", status_code=400)
            return PlainTextResponse("OK")
        q = request.query_params
        if not all(q.get(k) for k in ROUTE_QUERY):
            return PlainTextResponse("Missing inputs for bootstrap server.", status_code=400)
        if not table.ready:
            return PlainTextResponse(f"Prefill server not fully registered yet ({len(table.ranks)} workers "
                                     f"registered).", status_code=503)
        try:
            key = tuple(int(q[k]) for k in ROUTE_QUERY)
        except ValueError:
            return PlainTextResponse("Bad inputs for bootstrap server.", status_code=400)
        if key == (-1, -1, -1, -1):
            return JSONResponse(table.info)
        if key not in table.ranks:
            return PlainTextResponse(f"Bootstrap info not found for dp_rank={key[0]} cp_rank={key[1]} "
                                     f"tp_rank={key[2]} pp_rank={key[3]}", status_code=404)
        return JSONResponse(table.ranks[key])

    async def health(request: Request) -> Response:
        return PlainTextResponse("OK")

    async def register_dp_rank(request: Request) -> Response:
        data = await request.json()
        table.room_dp[int(data["bootstrap_room"])] = int(data["dp_rank"])
        return PlainTextResponse("OK")

    async def query_dp_ranks(request: Request) -> Response:
        data = await request.json()
        return JSONResponse({str(int(r)): table.room_dp[int(r)] for r in data["bootstrap_rooms"]
                             if int(r) in table.room_dp})

    async def kv_register(request: Request) -> Response:
        data = await request.json()
        rooms.decoders[str(data["session_id"])] = PoolLayout.from_json(data["layout"])
        return PlainTextResponse("OK")

    async def kv_transfer(request: Request) -> Response:
        data = await request.json()
        session = str(data["session_id"])
        if session not in rooms.decoders:
            return PlainTextResponse(f"unknown session {session}: register it first", status_code=404)
        room = rooms.target(int(data["bootstrap_room"]), session, [int(s) for s in data["slots"]],
                            int(data["num_tokens"]))
        return StreamingResponse(rooms.report(room), media_type="application/x-ndjson")

    async def kv_abort(request: Request) -> Response:
        data = await request.json()
        state = await rooms.abort(int(data["bootstrap_room"]))
        return JSONResponse({"state": state.name.lower()})

    return Starlette(routes=[
        Route("/route", route, methods=["GET", "PUT"]),
        Route("/health", health, methods=["GET"]),
        Route("/register_dp_rank", register_dp_rank, methods=["POST"]),
        Route("/query_dp_ranks", query_dp_ranks, methods=["POST"]),
        Route("/kv/register", kv_register, methods=["POST"]),
        Route("/kv/transfer", kv_transfer, methods=["POST"]),
        Route("/kv/abort", kv_abort, methods=["POST"]),
    ])


def line(state: KVPoll, **extra) -> bytes:
    """One NDJSON line of ``/kv/transfer``."""
    return (json.dumps({"state": state.name.lower(), **extra}) + "\n").encode()


async def serve(app: Starlette, host: str, port: int, shutdown: asyncio.Event) -> None:
    """Serve ``app`` on ``host:port`` until ``shutdown`` is set (hypercorn, this loop)."""
    from hypercorn.asyncio import serve as hyper_serve
    from hypercorn.config import Config

    hc = Config()
    hc.bind = [f"{host}:{port}"]
    hc.accesslog = None
    hc.graceful_timeout = 1.0
    await hyper_serve(app, hc, shutdown_trigger=shutdown.wait)
