"""The simulated server's control routes: vLLM's dev-mode routes (``/reset_prefix_cache``,
``/sleep``, ``/wake_up``, ``/is_sleeping``; always on here) and the simulator's own
``/sim/faults`` (read, replace, patch the ``FaultConfig``) and ``/sim/stats`` (read,
reset what this backend received; the dev-mode calls are counted in ``control`` and each
kept in ``control_calls`` with its time and result)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.sim import protocol as P
from gateway.sim.asgi import error_response, json_response
from gateway.sim.faults import FaultConfig
from gateway.sim.state import SimState


def add_control_routes(app: FastAPI, state: SimState) -> None:
    """Mount the dev-mode and ``/sim/*`` routes on ``app``, acting on ``state``."""
    runner = state.runner

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        reset_running_requests: bool = False, reset_external: bool = False
    ) -> Response:
        if reset_running_requests:
            runner.abort_all()
        ok = runner.engine.reset_prefix_cache()
        state.record_control("/reset_prefix_cache", ok)
        return json_response({"success": ok})

    @app.post("/sleep")
    async def sleep(level: int = 1) -> Response:
        if not 0 <= level <= 2:
            return error_response(
                P.validation_error(
                    "less_than_equal",
                    "query.level",
                    "Input should be less than or equal to 2",
                    level,
                )
            )
        runner.abort_all()
        runner.engine.reset_prefix_cache()
        state.sleep_level = max(level, 1)
        state.record_control("/sleep", True)
        return json_response({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        state.sleep_level = 0
        state.record_control("/wake_up", True)
        return json_response({"status": "awake", "tags": tags})

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": state.sleep_level > 0})

    @app.get("/sim/faults")
    async def get_faults() -> Response:
        return json_response(state.faults.config.model_dump())

    @app.api_route("/sim/faults", methods=["POST", "PUT", "PATCH"])
    async def set_faults(request: Request) -> Response:
        """POST/PUT replace the whole FaultConfig; PATCH (or POST ?merge=true) merges."""
        try:
            body = P.parse_json_body(await request.body())
            merge = request.method == "PATCH" or request.query_params.get("merge") in (
                "1",
                "true",
                "yes",
            )
            new = (
                state.faults.patch(body)
                if merge
                else state.faults.replace(FaultConfig.model_validate(body))
            )
        except P.SimHTTPError as err:
            return error_response(err)
        except ValueError as exc:  # pydantic.ValidationError
            return error_response(P.error(400, str(exc), "BadRequestError"))
        return json_response(new.model_dump())

    def stats_response() -> Response:
        # ASCII JSON: recorded bodies may hold lone surrogates ("\ud800"), which have no
        # UTF-8 form but a JSON escape
        return Response(json.dumps(state.snapshot()), media_type="application/json")

    @app.get("/sim/stats")
    async def get_stats() -> Response:
        return stats_response()

    @app.delete("/sim/stats")
    async def reset_stats() -> Response:
        state.reset_stats()
        return stats_response()
