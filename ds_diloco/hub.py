"""Publish an exported folder to the Hugging Face Hub, through ``huggingface_hub``.

The repository is created if missing, the branch too, and the whole folder goes
up as one commit (``create_commit``: ``upload_folder`` may split a large folder
into several commits when ``hf_xet`` is installed). The token comes from where
``huggingface_hub`` looks (``$HF_TOKEN``, then ``hf auth login``'s file);
``$HF_ENDPOINT`` is read at call time, since ``huggingface_hub`` reads it once,
at import.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload every file of ``folder`` to model repo ``repo_id`` in one commit; returns its URL.

    In the same commit, the repo's weight and tokenizer files that the folder does not
    have are deleted (:func:`_replaced`): left there, an earlier push's
    ``model.safetensors`` was loaded instead of a sharded one's index, another dtype's
    or size's weights stayed beside the new ones, a tokenizer's old files beside its new
    ones. Other files of the repo (a user's own) stay."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file() and ".git" not in p.parts)
    if not files:
        raise ValueError(f"nothing to push: {str(root)!r} holds no files")
    token = resolve_token(repo_id, token)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    operations = [
        CommitOperationAdd(path_in_repo=p.relative_to(root).as_posix(), path_or_fileobj=str(p))
        for p in files
    ]
    try:
        # private=None: a new repo gets the account's default visibility; an existing one keeps its own.
        api.create_repo(repo_id, private=private or None, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        sent = {op.path_in_repo for op in operations}
        stale = [f for f in _repo_files(api, repo_id, revision) if f not in sent and _replaced(f)]
        if stale:
            log.info("deleting from %s what this push replaces: %s", repo_id, stale)
        operations += [CommitOperationDelete(path_in_repo=f) for f in stale]
        commit = api.create_commit(
            repo_id,
            operations,
            commit_message=commit_message or f"Upload {root.name} (ds-diloco export)",
            revision=revision,
            repo_type="model",
        )
    except OfflineModeIsEnabled:
        raise ValueError(f"cannot push to {repo_id}: $HF_HUB_OFFLINE is set") from None
    except HfHubHTTPError as e:
        raise ValueError(f"the Hub at {api.endpoint} refused the push to {repo_id}: {e}") from None
    except _transport_errors() as e:  # no network, host unknown, refused, timed out
        raise ValueError(
            f"cannot push to {repo_id}: the Hub at {api.endpoint} cannot be reached "
            f"({type(e).__name__}: {e})"
        ) from None
    log.info("pushed %d files to %s: %s", len(files), repo_id, commit.commit_url)
    return commit.commit_url


_TOKENIZER_FILES = {
    "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json",  # AutoTokenizer applies one left there
}  # fmt: skip
_WEIGHTS = re.compile(r"\.(safetensors|bin|pt|pth|gguf|msgpack|h5)$|\.index\.json$")


def _replaced(path: str) -> bool:
    """A file of the kinds an export writes and a model loads by name: weights, their
    index, tokenizer files (at the repo's top level, where they are loaded from)."""
    return "/" not in path and (path in _TOKENIZER_FILES or bool(_WEIGHTS.search(path)))


def _repo_files(api, repo_id: str, revision: str | None) -> list[str]:
    """The files at ``revision`` of the repo; none for a repo or branch just made."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return api.list_repo_files(repo_id, revision=revision, repo_type="model")
    except HfHubHTTPError as e:
        if getattr(e.response, "status_code", None) == 404:
            return []
        raise


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a failed connection raises: OSError (requests' errors are OSErrors too), and the
    request errors of the httpx flavour ``huggingface_hub`` uses (``httpx2`` in 2.x, ``httpx``
    in 1.x), which are not OSErrors. Not Exception: a programming error keeps its traceback."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(importlib.import_module(name).RequestError)
    return tuple(errors)


def resolve_token(repo_id: str, token: str | None = None) -> str:
    """The Hub token (given, else $HF_TOKEN, else the login file); checked before a long
    export, with ``repo_id``'s form and the offline mode (huggingface_hub finds them only at
    the push)."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except ValueError as e:  # HFValidationError
        raise ValueError(f"Hub repo {repo_id!r} is not a valid repo id: {e}") from None
    token = token or get_token()
    if not token:
        raise ValueError(
            f"pushing to {repo_id} needs a Hugging Face token: set $HF_TOKEN or run `hf auth login`"
        )
    if constants.is_offline_mode():  # as push_folder would find it, after the export
        raise ValueError(f"cannot push to {repo_id}: $HF_HUB_OFFLINE is set")
    return token
