"""The gateway's REST adapter: the Open Inference Protocol's HTTP routes (what tritonclient.http calls).

Each handler decodes its request with `oip`, asks the dataplane and encodes the answer; an `oip.OipError`
becomes its HTTP status with a JSON `error` body. Nothing here decides anything (`docs/architecture.md`).
"""

from __future__ import annotations

from aiohttp import web

from volga_agent.gateway import dataplane, oip


def _error(exc: oip.OipError) -> web.Response:
    return web.Response(status=exc.http_status, body=oip.rest_error_body(exc), content_type="application/json")


def _model(request: web.Request, headers: dict[str, str] | None = None) -> str:
    if headers is None:
        headers = dataplane.headers(request.headers.items())
    return dataplane.model_id(headers, request.match_info["model"])


def app(plane: dataplane.Dataplane) -> web.Application:
    async def live(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_metadata(_: web.Request) -> web.Response:
        return web.json_response({"name": dataplane.SERVER_NAME, "version": dataplane.SERVER_VERSION,
                                  "extensions": list(dataplane.EXTENSIONS)})

    async def model_ready(request: web.Request) -> web.Response:
        return web.Response(status=200 if plane.model_ready(_model(request)) else 400)

    async def model_metadata(request: web.Request) -> web.Response:
        try:
            m = plane.model_metadata(_model(request))
        except oip.OipError as exc:
            return _error(exc)
        return web.json_response(oip.model_metadata_rest(m.name, m.versions, m.platform, m.inputs, m.outputs))

    async def repository_index(_: web.Request) -> web.Response:
        return web.json_response([{"name": m.name, "version": m.version, "state": m.state}
                                  for m in plane.repository_index()])

    async def infer(request: web.Request) -> web.Response:
        headers = dataplane.headers(request.headers.items())
        model = _model(request, headers)

        async def call() -> web.Response:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise oip.error("RESOURCE_EXHAUSTED", f"request body over {plane.max_request_bytes} bytes") from None
            length = oip.rest_header_length(headers.get("inference-header-content-length"))
            decoded = oip.decode_rest_request(body, length)
            spec, outputs = await plane.infer(model, headers, decoded.inputs)
            payload, json_length = oip.encode_rest_response(spec.model_id, spec.version, decoded.request_id, outputs,
                                                            decoded.outputs, decoded.binary_default)
            if json_length is None:
                return web.Response(body=payload, headers={"Content-Type": "application/json"})
            return web.Response(body=payload, headers={"Content-Type": "application/octet-stream",
                                                       "Inference-Header-Content-Length": str(json_length)})

        try:
            return await plane.observe(model, "http", call)
        except oip.OipError as exc:
            return _error(exc)

    web_app = web.Application(client_max_size=plane.max_request_bytes)
    web_app.router.add_get("/v2/health/live", live)
    web_app.router.add_get("/v2/health/ready", live)
    web_app.router.add_get("/v2", server_metadata)
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        web_app.router.add_get(prefix, model_metadata)
        web_app.router.add_get(f"{prefix}/ready", model_ready)
        web_app.router.add_post(f"{prefix}/infer", infer)
    web_app.router.add_post("/v2/repository/index", repository_index)
    return web_app
