"""Publishing an export: ``ds-diloco export --push-to-hub`` against a local stand-in Hub.

The Hub is unreachable from here, so this file runs an HTTP server that answers
just the endpoints ``huggingface_hub`` calls for a push (repo create, branch,
README metadata check, preupload, Git LFS batch and upload, commit), records
every request, and keeps what it was sent. The product only talks to
``huggingface_hub``; the protocol lives here, in the test.

``hf_xet`` (when installed) sends LFS files to a separate content-addressed
store with its own binary protocol, so the test turns it off and
``huggingface_hub`` takes its plain Git LFS path.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from ds_diloco import cli
from ds_diloco.config import CoordinatorConfig, ModelSource
from ds_diloco.data import train_tokenizer
from ds_diloco.hub import push_folder
from ds_diloco.server import ServerThread

HF_TOKEN = "hf_test_token_123"
SONNETS = Path(__file__).parent / "data" / "sonnets.txt"


class FakeHub:
    """The Hub endpoints of a push, in memory. ``requests``: (method, path, headers)."""

    def __init__(self):
        self.requests: list[tuple[str, str, dict]] = []
        self.unexpected: list[str] = []
        self.repos: dict[str, dict] = {}  # repo id -> create payload
        self.branches: list[tuple[str, str]] = []
        self.lfs: dict[str, bytes] = {}  # sha256 -> bytes received by PUT
        self.commits: list[dict] = []  # {repo, revision, summary, files: {path: bytes}, deleted}
        self.trees: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo, revision) -> files
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                hub.handle(self, "POST")

            def do_PUT(self):
                hub.handle(self, "PUT")

            def do_GET(self):
                hub.handle(self, "GET")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def body(req: BaseHTTPRequestHandler) -> bytes:
        if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(req.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    req.rfile.readline()
                    return bytes(out)
                out += req.rfile.read(size)
                req.rfile.readline()
        return req.rfile.read(int(req.headers.get("Content-Length") or 0))

    @staticmethod
    def reply(req: BaseHTTPRequestHandler, status: int, obj=None) -> None:
        data = json.dumps(obj if obj is not None else {}).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def handle(self, req: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(req.path).path)
        body = self.body(req)
        self.requests.append((method, path, dict(req.headers)))
        parts = path.strip("/").split("/")
        try:
            if method == "POST" and path == "/api/repos/create":
                return self.create_repo(req, json.loads(body))
            if method == "GET" and parts[:2] == ["api", "models"] and parts[4:5] == ["tree"]:
                return self.tree(req, "/".join(parts[2:4]), "/".join(parts[5:]))
            if method == "POST" and path == "/api/validate-yaml":
                return self.reply(req, 200, {"errors": [], "warnings": []})
            if method == "POST" and parts[:2] == ["api", "models"] and len(parts) >= 6:
                repo, action, rev = "/".join(parts[2:4]), parts[4], "/".join(parts[5:])
                if action == "branch":
                    self.branches.append((repo, rev))
                    return self.reply(req, 200)
                if action == "preupload":
                    return self.preupload(req, json.loads(body))
                if action == "commit":
                    return self.commit(req, repo, rev, body)
            if method == "POST" and path.endswith(".git/info/lfs/objects/batch"):
                return self.lfs_batch(req, json.loads(body))
            if method == "PUT" and parts[0] == "lfs-storage":
                oid = parts[1]
                if hashlib.sha256(body).hexdigest() != oid:
                    return self.reply(req, 400, {"error": "sha256 does not match the oid"})
                self.lfs[oid] = body
                return self.reply(req, 200)
        except Exception as e:  # a malformed request: fail loudly in the test
            self.unexpected.append(f"{method} {path}: {e!r}")
            return self.reply(req, 500, {"error": repr(e)})
        self.unexpected.append(f"{method} {path}")
        return self.reply(req, 404, {"error": "not found"})

    # ------------------------------------------------------------------ endpoints
    def create_repo(self, req, payload: dict) -> None:
        repo = f"{payload['organization']}/{payload['name']}"
        if repo in self.repos:
            return self.reply(req, 409, {"error": "You already created this model repo",
                                         "url": f"{self.url}/{repo}"})  # fmt: skip
        self.repos[repo] = payload
        return self.reply(req, 200, {"url": f"{self.url}/{repo}"})

    def tree(self, req, repo: str, revision: str) -> None:
        if (repo, revision) not in self.trees:  # a repo or branch with no commit yet
            return self.reply(req, 404, {"error": "Revision not found"})
        files = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                 for p, b in sorted(self.trees[(repo, revision)].items())]  # fmt: skip
        return self.reply(req, 200, files)

    def preupload(self, req, payload: dict) -> None:
        files = [
            {"path": f["path"], "shouldIgnore": False, "oid": None,
             "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular"}
            for f in payload["files"]
        ]  # fmt: skip
        return self.reply(req, 200, {"files": files})

    def lfs_batch(self, req, payload: dict) -> None:
        assert payload["operation"] == "upload" and "basic" in payload["transfers"]
        objects = [
            {"oid": o["oid"], "size": o["size"], "authenticated": True,
             "actions": {"upload": {"href": f"{self.url}/lfs-storage/{o['oid']}"}}}
            for o in payload["objects"]
        ]  # fmt: skip
        return self.reply(req, 200, {"transfer": "basic", "objects": objects})

    def commit(self, req, repo: str, revision: str, body: bytes) -> None:
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header, ops = lines[0], lines[1:]
        assert header["key"] == "header"
        files, deleted = {}, []
        for op in ops:
            v = op["value"]
            if op["key"] == "file":
                assert v["encoding"] == "base64"
                files[v["path"]] = base64.b64decode(v["content"])
            elif op["key"] == "lfsFile":
                if v["oid"] not in self.lfs:
                    return self.reply(req, 422, {"error": f"LFS object of {v['path']} missing"})
                files[v["path"]] = self.lfs[v["oid"]]
            elif op["key"] == "deletedFile":
                deleted.append(v["path"])
            else:
                raise ValueError(f"unexpected commit operation {op['key']}")
        n = len(self.commits)
        self.commits.append({"repo": repo, "revision": revision, "deleted": deleted,
                             "summary": header["value"]["summary"], "files": files})  # fmt: skip
        tree = self.trees.setdefault((repo, revision), {})
        tree.update(files)
        for path in deleted:
            del tree[path]
        oid = hashlib.sha1(str(n).encode()).hexdigest()
        return self.reply(req, 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}",
                                     "commitOid": oid, "pullRequestUrl": None})  # fmt: skip


@pytest.fixture
def hub(monkeypatch):
    """A stand-in Hub, with huggingface_hub pointed at it as a user would: $HF_ENDPOINT, $HF_TOKEN."""
    import huggingface_hub._commit_api
    from huggingface_hub import constants

    fake = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    # huggingface_hub reads these once, at import (conftest set HF_HUB_OFFLINE=1 before it).
    # constants.ENDPOINT is left at huggingface.co: the product must pass $HF_ENDPOINT itself.
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # no agent-registry fetch
    monkeypatch.setattr(huggingface_hub._commit_api, "is_xet_available", lambda: False)
    yield fake
    fake.close()


@pytest.fixture
def state_dir(tmp_path, tiny_config_path):
    """A coordinator's state directory (the tiny Llama at version 0)."""
    cfg = CoordinatorConfig(
        model=ModelSource(config=tiny_config_path, seed=0),
        state_dir=str(tmp_path / "state"),
        num_fragments=4,
        sync_every=4,
        token="t",
    )
    with ServerThread(cfg):
        pass
    return tmp_path / "state"


def folder_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_export_pushes_every_file_in_one_commit(hub, state_dir, tmp_path, capsys):
    train_tokenizer([SONNETS], 384, tmp_path / "tok")
    out = tmp_path / "hf"
    argv = ["export", "--from", str(state_dir), "--out", str(out), "--tokenizer",
            str(tmp_path / "tok"), "--max-shard-size", "100KB",
            "--push-to-hub", "someone/tiny-diloco"]  # fmt: skip
    assert cli.main(argv) == 0
    assert "pushed" in capsys.readouterr().out
    assert not hub.unexpected, hub.unexpected

    sent = folder_files(out)
    shards = [f for f in sent if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in sent  # sharded
    assert {"README.md", "config.json", "generation_config.json", "tokenizer.json"} <= set(sent)
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    assert (commit["repo"], commit["revision"]) == ("someone/tiny-diloco", "main")
    assert commit["files"] == sent  # every file, byte for byte
    assert set(hub.lfs) == {hashlib.sha256(sent[f]).hexdigest() for f in shards}  # through LFS
    assert hub.repos["someone/tiny-diloco"].get("visibility") != "private"
    assert "# tiny-diloco" in sent["README.md"].decode()  # the card is named after the repo

    api_calls = [(m, p, h) for m, p, h in hub.requests if not p.startswith("/lfs-storage/")]
    assert {h.get("authorization") or h.get("Authorization") for _, _, h in api_calls} == {
        f"Bearer {HF_TOKEN}"
    }
    assert api_calls[0][:2] == ("POST", "/api/repos/create")


def test_push_to_an_existing_repo_on_a_branch(hub, tmp_path):
    folder = tmp_path / "f"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "model.safetensors").write_bytes(bytes(range(256)) * 100)
    hub.repos["someone/x"] = {}  # it exists: create answers 409, which is fine
    url = push_folder(folder, "someone/x", private=True, revision="ckpt-100")
    assert not hub.unexpected, hub.unexpected
    assert url.startswith(f"{hub.url}/someone/x/commit/")
    assert hub.branches == [("someone/x", "ckpt-100")]
    assert [(c["revision"], c["files"]) for c in hub.commits] == [
        ("ckpt-100", folder_files(folder))
    ]

    # Create was asked, answered 409 (already there), and the push went on.
    assert ("POST", "/api/repos/create") in [(m, p) for m, p, _ in hub.requests]
    assert hub.repos["someone/x"] == {}


def test_the_card_of_a_push_to_a_branch_loads_that_branch(hub, state_dir, tmp_path):
    # Its snippet loaded the repo's main branch: another model, or none at all.
    train_tokenizer([SONNETS], 384, tmp_path / "tok")
    argv = ["export", "--from", str(state_dir), "--out", str(tmp_path / "hf"), "--tokenizer",
            str(tmp_path / "tok"), "--push-to-hub", "someone/x", "--revision", "ckpt-100"]  # fmt: skip
    assert cli.main(argv) == 0
    (commit,) = hub.commits
    card = commit["files"]["README.md"].decode()
    assert commit["revision"] == "ckpt-100"
    assert 'AutoModelForCausalLM.from_pretrained("someone/x", revision="ckpt-100")' in card
    assert 'AutoTokenizer.from_pretrained("someone/x", revision="ckpt-100")' in card


def test_a_push_deletes_the_weights_and_tokenizer_files_it_replaces(hub, tmp_path):
    # Pushes only added files: a sharded export over a single-file one left model.safetensors
    # there, which from_pretrained loads before the index (the old model), and an earlier
    # tokenizer's files beside the new ones. A user's own files stay.
    first, second = tmp_path / "one", tmp_path / "two"
    for folder, files in ((first, ["model.safetensors", "vocab.json", "merges.txt"]),
                          (second, ["model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors",
                                    "model.safetensors.index.json", "tokenizer.json"])):  # fmt: skip
        folder.mkdir()
        for name in [*files, "config.json"]:
            (folder / name).write_text(f"{folder.name} {name}")
    push_folder(first, "someone/x")
    hub.trees[("someone/x", "main")]["notes.md"] = b"the user's own"
    push_folder(second, "someone/x")
    assert not hub.unexpected, hub.unexpected
    assert sorted(hub.commits[1]["deleted"]) == ["merges.txt", "model.safetensors", "vocab.json"]
    assert hub.trees[("someone/x", "main")] == {
        **folder_files(second),
        "notes.md": b"the user's own",
    }


def test_a_push_deletes_an_earlier_tokenizers_chat_template(hub, tmp_path):
    # An instruct model's export (SmolLM2: chat_template.jinja) pushed, then one whose
    # tokenizer has no chat template: the old template stayed, and AutoTokenizer applied it.
    first, second = tmp_path / "one", tmp_path / "two"
    for folder, files in ((first, ["chat_template.jinja", "chat_template.json"]), (second, [])):
        folder.mkdir()
        for name in [*files, "config.json", "tokenizer.json", "tokenizer_config.json"]:
            (folder / name).write_text(f"{folder.name} {name}")
    push_folder(first, "someone/x")
    push_folder(second, "someone/x")
    assert not hub.unexpected, hub.unexpected
    assert sorted(hub.commits[1]["deleted"]) == ["chat_template.jinja", "chat_template.json"]
    assert hub.trees[("someone/x", "main")] == folder_files(second)


def test_push_needs_a_token_before_exporting(hub, state_dir, tmp_path, monkeypatch, capsys):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    argv = ["export", "--from", str(state_dir), "--out", str(tmp_path / "hf"),
            "--push-to-hub", "someone/x"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "needs a Hugging Face token: set $HF_TOKEN" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists() and not hub.requests


@pytest.mark.parametrize("repo", ["me/my model", "a/b/c", "me/x--y"])
def test_a_repo_id_the_hub_refuses_is_named_before_exporting(
    repo, state_dir, tmp_path, monkeypatch, capsys
):
    # Found by huggingface_hub only at the push: after the export (minutes from a live
    # coordinator), or at the end of a whole `ds-diloco run`.
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    argv = ["export", "--from", str(state_dir), "--out", str(tmp_path / "hf"),
            "--push-to-hub", repo]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds-diloco: error: Hub repo {repo!r} is not a valid repo id: "), err
    assert not (tmp_path / "hf").exists()


def test_push_in_offline_mode_is_refused_before_exporting(state_dir, tmp_path, monkeypatch, capsys):
    # Found only at the push: after the export, or at the end of a whole `ds-diloco run`.
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    argv = ["export", "--from", str(state_dir), "--out", str(tmp_path / "hf"),
            "--push-to-hub", "someone/x"]  # fmt: skip
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "ds-diloco: error: cannot push to someone/x: $HF_HUB_OFFLINE is set\n"
    )
    assert not (tmp_path / "hf").exists()


def test_hub_errors_are_one_line(hub, tmp_path, monkeypatch):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(FakeHub, "create_repo", lambda self, req, payload: self.reply(
        req, 403, {"error": "You don't have the rights to create a model under this namespace"}
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"refused the push to someone/x: .*403"):
        push_folder(folder, "someone/x")
    assert not hub.commits


def test_private_and_revision_need_a_repo(state_dir, tmp_path, capsys):
    argv = ["export", "--from", str(state_dir), "--out", str(tmp_path / "hf"), "--private"]
    assert cli.main(argv) == 2
    assert "--private and --revision go with --push-to-hub" in capsys.readouterr().err


def test_an_unreachable_hub_is_one_line_and_the_export_stays(
    state_dir, tmp_path, monkeypatch, capsys
):
    # No network: a connection refused (httpx's ConnectError, not an HfHubHTTPError) ended
    # in an 80-line traceback.
    import socket

    from huggingface_hub import constants

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    out = tmp_path / "hf"
    argv = ["export", "--from", str(state_dir), "--out", str(out), "--push-to-hub", "me/tiny"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after transformers' progress bar
    assert last.startswith("ds-diloco: error: cannot push to me/tiny: ") and "Traceback" not in err
    assert "cannot be reached" in last and "refused" in last.lower(), last
    assert {"config.json", "model.safetensors", "README.md"} <= set(folder_files(out))
