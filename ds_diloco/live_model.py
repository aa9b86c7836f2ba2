"""What ``ds-diloco run`` does with the live global model while the islands train:
periodic exports (``export_every_merges``) and held-out evaluations
(``eval_every_merges``). Each runs one at a time in a background thread, every N merges
summed over fragments: the run never waits for it, and one that fails is reported and
tried again at the next multiple.

The islands' own losses are those of their local models; the held-out loss of the
merged (global) model is what the run produces, and the one to watch.
"""

from __future__ import annotations

import threading
import time

import torch


def next_due(merges: int, every: int) -> int:
    """The first multiple of ``every`` above ``merges``: when the next one is due."""
    return (merges // every + 1) * every


class EveryMerges:
    """Calls ``work(merges)`` in a background thread each time the coordinator's merges,
    summed over fragments, reach the next multiple of ``every`` (0: never), one at a time."""

    def __init__(self, every: int):
        self.every = every
        self.last = 0  # merges when the last one started
        self.thread: threading.Thread | None = None

    def maybe(self, status: dict | None) -> None:
        if not self.every or status is None:
            return
        if sum(status["merges"]) < next_due(self.last, self.every):
            return
        if self.thread is not None and self.thread.is_alive():
            return  # the previous one is still at work: catch up at the next print
        merges = self.last = sum(status["merges"])
        self.thread = threading.Thread(target=self.work, args=(merges,), daemon=True)
        self.thread.start()

    def resume_at(self, merges: int) -> None:
        """The next call after ``merges`` made already (a resumed run)."""
        self.last = merges

    def finish(self, status: dict | None) -> None:
        """Once the islands are done: wait for the one at work, then call ``work`` once
        more, here, if merges were made since it started."""
        self.join()
        if self.every and status is not None and sum(status["merges"]) > self.last:
            self.last = sum(status["merges"])
            self.work(self.last)

    def work(self, merges: int) -> None:
        raise NotImplementedError

    def join(self, timeout_s: float = 600.0) -> None:
        if self.thread is not None:
            self.thread.join(timeout=timeout_s)


class PeriodicExport(EveryMerges):
    """Exports (and pushes) the live global model into ``workdir/exports/merges-<n>``."""

    def __init__(self, cfg, lr):
        super().__init__(cfg.export_every_merges)
        self.cfg, self.lr = cfg, lr
        self.done: list[str] = []

    def work(self, merges: int) -> None:
        from ds_diloco.data import section_tokenizer
        from ds_diloco.export import load_global, write_export
        from ds_diloco.model_card import RunSummary
        from ds_diloco.run import card_settings

        d = self.cfg.data
        tok = section_tokenizer(d)
        try:
            settings = RunSummary.from_json(card_settings(self.cfg))  # the card's run settings
            g = load_global(self.lr.url, self.lr.token, ca_file=self.lr.ca_file)
            # Named after the merges it holds (those made since ``merges`` set it off too),
            # as its card and the evaluations at the same versions count them.
            out = self.lr.workdir / "exports" / f"merges-{sum(g.merges or [merges])}"
            write_export(g, out, tokenizer=tok, repo=self.cfg.push_to_hub, run_summary=settings)
            del g  # its tensors (the whole model) go before the push
            if self.cfg.push_to_hub:
                from ds_diloco.hub import push_folder

                push_folder(out, self.cfg.push_to_hub)
            self.done.append(str(out))
            print(f"[export] {out}" + (f" -> {self.cfg.push_to_hub}" if self.cfg.push_to_hub
                                       else ""), flush=True)  # fmt: skip
        except Exception as e:  # a failed export must not stop the run
            print(f"[export] at {merges} merges failed: {e}", flush=True)


class PeriodicEval(EveryMerges):
    """The held-out loss of the live global model (one consistent set of served versions,
    read as an export reads it) on the run's held-out blocks: printed, written to
    TensorBoard (``global/heldout_loss`` by merges) and kept in ``records`` (the run's
    summary.json ``global_evals``)."""

    def __init__(self, cfg, lr, heldout: torch.Tensor, board=None):
        super().__init__(cfg.eval_every_merges)
        self.lr, self.heldout, self.board = lr, heldout, board
        self.records: list[dict] = []
        self._t0 = time.monotonic()

    def work(self, merges: int) -> None:
        from ds_diloco.global_eval import describe, evaluate_global

        try:
            record = evaluate_global(self.lr.url, self.heldout, self.lr.token, self.lr.ca_file)
        except Exception as e:  # a failed evaluation must not stop the run
            print(f"[eval] at {merges} merges failed: {e}", flush=True)
            return
        record["t_s"] = round(time.monotonic() - self._t0, 1)
        self.records.append(record)
        if self.board is not None:
            self.board.scalar("global/heldout_loss", record["heldout_loss"], record["merges"])
        print(f"[eval] {describe(record)}", flush=True)
