"""HTTP client of the coordinator's wire API, used by islands, tests and benchmarks.

Connection failures are retried with bounded exponential backoff and logged;
a 4xx is the coordinator refusing the request and is raised at once as
:class:`RefusedError` with the coordinator's message.
"""

from __future__ import annotations

import logging
import time

import requests
import torch

from ds_diloco import wire
from ds_diloco.fragments import Fragment
from ds_diloco.sharding import shard_range

log = logging.getLogger(__name__)


class RefusedError(RuntimeError):
    """The coordinator answered 4xx: the request was wrong and changed nothing."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class CoordinatorClient:
    def __init__(
        self,
        url: str,
        token: str,
        *,
        timeout_s: float = 60.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def _request(self, method: str, path: str, **kw) -> requests.Response:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                r = self.session.request(method, self.url + path, timeout=self.timeout_s, **kw)
            except requests.ConnectionError as e:
                if attempt == self.retries:
                    raise
                log.warning(
                    "%s %s failed (%s); retry %d in %.1fs", method, path, e, attempt + 1, delay
                )
                time.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
                continue
            if 400 <= r.status_code < 500:
                try:
                    msg = r.json().get("error", r.text)
                except ValueError:
                    msg = r.text
                raise RefusedError(r.status_code, msg)
            r.raise_for_status()
            return r
        raise AssertionError("unreachable")

    def health(self) -> dict:
        return self._request("GET", "/healthz").json()

    def status(self) -> dict:
        return self._request("GET", "/v1/status").json()

    def plan(self) -> dict:
        return self._request("GET", "/v1/plan").json()

    def model_config(self) -> dict:
        return self._request("GET", "/v1/model-config").json()

    def versions(
        self, island: str | None = None, known: list[int] | None = None, wait: float = 0.0
    ) -> list[int]:
        """Current versions; with ``known`` and ``wait``, once one is newer (long poll)."""
        params = {}
        if island:
            params["island"] = island
        if known is not None:
            params["known"] = ",".join(map(str, known))
            params["wait"] = wait
        return self._request("GET", "/v1/versions", params=params).json()["versions"]

    def register(self, island: str, world_size: int, signature: str) -> dict:
        body = {"island": island, "world_size": world_size, "signature": signature}
        return self._request("POST", "/v1/islands", json=body).json()

    def start(self, island: str) -> dict:
        """Say ``island`` takes its first step now: {"started": how many of the run's islands
        have, "clock": where the rounds' schedule is, in steps mod H, or None}."""
        return self._request("POST", f"/v1/islands/{island}/start").json()

    def leave(self, island: str) -> dict:
        """The island leaves the run for good (a later register brings it back)."""
        return self._request("DELETE", f"/v1/islands/{island}").json()

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    def upload(self, header: wire.UploadHeader, slices: dict[str, torch.Tensor]) -> dict:
        # Streamed from the slices' memory: no copy of the pseudo-gradient is made.
        return self.upload_body(wire.upload_parts(header, slices))

    def upload_body(self, body: bytes | wire.Body) -> dict:
        headers = {"Content-Type": "application/octet-stream"}
        return self._request("POST", "/v1/upload", data=body, headers=headers).json()

    def download(
        self,
        fragment: int,
        world_size: int,
        rank: int,
        after: int | None = None,
        island: str | None = None,
    ) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, slices) of this rank's part of a fragment; None if not newer than ``after``."""
        params = {"world_size": world_size, "rank": rank}
        if after is not None:
            params["after"] = after
        if island:
            params["island"] = island
        r = self._request("GET", f"/v1/fragments/{fragment}", params=params)
        if r.status_code == 304:
            return None
        header, slices = wire.decode_fragment(r.content)
        if header.fragment != fragment or header.world_size != world_size or header.rank != rank:
            raise wire.WireError(
                f"download answered {header}, asked for fragment {fragment} "
                f"rank {rank}/{world_size}"
            )
        if int(r.headers.get(wire.VERSION_HEADER, header.version)) != header.version:
            raise wire.WireError("download: version header and body disagree")
        return header.version, slices

    def download_into(
        self,
        fragment: int,
        world_size: int,
        rank: int,
        dest: dict[str, torch.Tensor],
        after: int | None = None,
        island: str | None = None,
    ) -> int | None:
        """Like :meth:`download`, but read straight into ``dest`` (no buffer of the body).

        Returns the version, or None if not newer than ``after``. On an error ``dest``
        may hold part of the body: the caller must not use it.
        """
        params = {"world_size": world_size, "rank": rank}
        if after is not None:
            params["after"] = after
        if island:
            params["island"] = island
        with self._request("GET", f"/v1/fragments/{fragment}", params=params, stream=True) as r:
            if r.status_code == 304:
                return None
            try:
                length = int(r.headers["Content-Length"])
            except (KeyError, ValueError):
                raise wire.WireError("download without a Content-Length") from None
            r.raw.decode_content = False
            header, _ = wire.read_fragment_into(r.raw, length, dest)
        if header.fragment != fragment or header.world_size != world_size or header.rank != rank:
            raise wire.WireError(
                f"download answered {header}, asked for fragment {fragment} "
                f"rank {rank}/{world_size}"
            )
        if int(r.headers.get(wire.VERSION_HEADER, header.version)) != header.version:
            raise wire.WireError("download: version header and body disagree")
        return header.version


def rank_slices(
    fragment: Fragment, full: dict[str, torch.Tensor], world_size: int, rank: int
) -> dict[str, torch.Tensor]:
    """The flat slices of whole tensors that ``rank`` of ``world_size`` owns under ZeRO-3."""
    out = {}
    for p in fragment.params:
        a, b = shard_range(p.numel, world_size, rank)
        out[p.name] = full[p.name].reshape(-1)[a:b]
    return out
