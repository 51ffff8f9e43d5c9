"""The engine's weight endpoints: its weight version, pause and resume, and loading new weights in place.

vLLM 0.32 serves them at the server root when started with ``VLLM_SERVER_DEV_MODE=1`` (the embedded
engine is; see ``deploy/engine/server.py``), and answers 404 without it:

- ``GET /weight_info`` → ``{"weight_version": "default"}`` before any update, then the last version set;
- ``POST /pause?mode=wait`` → ``{"status": "paused"}`` once the requests it runs have finished (new ones
  queue until ``/resume``); the default ``clear_cache`` drops the KV and prefix caches;
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": PATH}}`` → every worker
  loads the Hugging Face checkpoint at ``PATH`` in place (kwargs travel as strings; ``is_checkpoint_format``
  keeps its default, true); ``{"results": [null, ...]}``;
- ``POST /update_weight_version {"new_version": V}`` → ``{"success": true, "new_version": V}``; generate's
  ``weight_versions`` spans then name ``V``;
- ``POST /reset_prefix_cache`` → ``{"success": bool}``;
- ``POST /resume`` → ``{"status": "resumed"}``.

The replies are recorded in ``tests/fixtures/vllm/weights_*.json``. Errors become
:class:`~proxy.errors.WeightUpdateFailed` with the engine's own message.

A failed ``reload_weights`` (a folder that does not exist, a checkpoint of another shape) leaves vLLM
0.32's model half-loaded (its parameters on the meta device): the next forward pass kills the engine
core. Reloading a good checkpoint while still paused repairs it, which is what the proxy does
(:meth:`proxy.policy.Policy.update`).

On vLLM 0.32's CPU build a model with tied embeddings (``tie_word_embeddings``, the tiny model's case)
keeps a pre-packed oneDNN copy of its output layer, which a reload refreshes only when the checkpoint
carries ``lm_head.weight`` itself (else the new embeddings meet the old output layer: the engine samples
from neither policy). ``save_pretrained`` leaves that tensor out of a tied model, so the trainer must
save it (the embedding matrix again); :func:`tied_head_missing` finds such a checkpoint when the proxy
can read it, and the proxy refuses it for a CPU engine (:meth:`WeightApi.is_cpu_build`). GPU builds
read the shared tensor directly and need nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson

from proxy.engine import translate_http_error
from proxy.errors import ProxyError, WeightApiMissing, WeightUpdateFailed

_JSON = {"content-type": "application/json"}
_MISSING_STATUSES = (403, 404, 405, 501)


def tied_head_missing(folder: str) -> bool:
    """Whether the checkpoint in ``folder`` ties its output layer to the embeddings (config.json) and does
    not store ``lm_head.weight``; False when this machine cannot read it (the engine may be elsewhere)."""
    root = Path(folder)
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        names = _tensor_names(root)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return bool(config.get("tie_word_embeddings")) and names is not None and "lm_head.weight" not in names


def _tensor_names(root: Path) -> set[str] | None:
    """The tensor names of a safetensors checkpoint (its index, or each file's header); None without one."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for file in files:
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        names.update(name for name in header if name != "__metadata__")
    return names


def _message(response: httpx.Response) -> str:
    """The engine's error text: vLLM's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``, or the body."""
    try:
        document = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:2000]
    if isinstance(document, dict):
        error = document.get("error", document.get("detail", document))
        if isinstance(error, dict):
            error = error.get("message") or error
        return str(error)[:2000]
    return str(document)[:2000]


class WeightApi:
    """Calls to one engine's weight endpoints, on the proxy's shared HTTP client."""

    def __init__(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        self._client = client
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    params: dict[str, str] | None = None, *, quick: bool = False) -> Any:
        """One request; ``quick`` ones (reading the version) use the client's own timeouts, the steps of an
        update the long one (loading a large checkpoint takes minutes).

        A request whose connection breaks without an answer is sent once more, on a new connection: vLLM
        closes the connection after a failed ``/collective_rpc`` (it answers the 500, then re-raises), so the
        very next step on that engine, the rollback's reload of the previous checkpoint, would otherwise meet
        a closed connection, and the engine would be resumed half-loaded. Every step may be repeated (the
        same pause, load, version, reset or resume twice does what it did once)."""
        for attempt in (0, 1):
            try:
                response = await self._client.request(
                    method, path, params=params, timeout=httpx.USE_CLIENT_DEFAULT if quick else self._timeout,
                    content=orjson.dumps(body) if body is not None else None,
                    headers=_JSON if body is not None else None)
                break
            except httpx.HTTPError as exc:
                if attempt == 0 and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
                    continue
                error = translate_http_error(exc)
                raise WeightUpdateFailed(f"engine {path}: {error.message}") from exc
        if response.status_code in _MISSING_STATUSES:
            raise WeightApiMissing(f"the engine does not serve {path} (HTTP {response.status_code}): start vLLM "
                                   "with VLLM_SERVER_DEV_MODE=1 for weight updates")
        if response.status_code != 200:
            raise WeightUpdateFailed(f"engine {path} failed with HTTP {response.status_code}: {_message(response)}")
        if not response.content:
            return None
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise WeightUpdateFailed(f"engine {path} reply is not JSON: {response.text[:200]}") from exc

    async def weight_version(self) -> str | None:
        """The engine's weight version as it reports it (vLLM says ``"default"`` before any update)."""
        document = await self._call("GET", "/weight_info", quick=True)
        version = document.get("weight_version") if isinstance(document, dict) else None
        return str(version) if version is not None else None

    async def served_folder(self) -> str | None:
        """The checkpoint folder the engine started from (``root`` on vLLM's ``/v1/models``), if it says."""
        document = await self._call("GET", "/v1/models", quick=True)
        try:
            root = document["data"][0].get("root")
        except (KeyError, IndexError, TypeError, AttributeError):
            return None
        return root if isinstance(root, str) and root else None

    async def is_cpu_build(self) -> bool:
        """Whether the engine runs on CPUs (vLLM's dev-mode ``/server_info`` names its device)."""
        try:
            document = await self._call("GET", "/server_info", quick=True)
        except ProxyError:
            return False
        config = document.get("vllm_config") if isinstance(document, dict) else None
        return isinstance(config, str) and "device_config=cpu," in config

    async def pause(self) -> None:
        """Stop scheduling: requests running finish first (``mode=wait``), new ones queue until resume."""
        await self._call("POST", "/pause", params={"mode": "wait"})

    async def reload_weights(self, weights_path: str) -> None:
        """Every worker loads the checkpoint folder ``weights_path`` into the running model, in place."""
        await self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": weights_path}})

    async def set_version(self, version: str) -> None:
        await self._call("POST", "/update_weight_version", {"new_version": version})

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks (computed by the old weights); False when the engine could not."""
        document = await self._call("POST", "/reset_prefix_cache")
        return bool(document.get("success", True)) if isinstance(document, dict) else True

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def resume_quietly(self) -> str | None:
        """Resume after a failed step; the error text if even that fails (the caller reports the first)."""
        try:
            await self.resume()
        except ProxyError as exc:
            return exc.message
        return None
