"""The compression state in Lightning checkpoints: stashed when Lightning loads one, restored when the
exchange is built (the entry's format: :mod:`lightning_gradcomp.exchange.checkpoint`)."""

from __future__ import annotations

from typing import Any, Optional

from typing_extensions import override

from lightning_gradcomp.exchange.checkpoint import CHECKPOINT_KEY, resolve_entry_on_every_rank, restore_entry


class RestoresCompressionState:
    """Mixin for the Trainer strategies' exchange state across a ``fit``: stash the checkpoint entry when
    Lightning loads a checkpoint (before ``setup``), apply it when ``setup`` builds the exchange state
    (``_restore_pending``); at ``teardown`` close the exchange state and drop an unused entry.

    The host class provides ``hook_state``, ``compressor``, ``compression_workers`` and
    ``_load_worker_states(ranks)``.
    """

    #: the checkpoint's entry and path, until the exchange of the coming ``fit`` is built
    _pending_checkpoint: Optional[tuple[dict[str, Any], Any]] = None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Keep the entry until the exchange state of the coming ``fit`` is built (``setup``), which restores it
        (this rank's part, read then from its file, when each rank saved its own)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        entry = checkpoint.get(CHECKPOINT_KEY)
        self._pending_checkpoint = None if entry is None else (entry, checkpoint_path)
        return checkpoint

    @override
    def teardown(self) -> None:
        """Close the exchange (its thread; non-finite warnings still in flight); an entry loaded for
        another stage (``validate``, ``test``) never reaches a later ``fit``."""
        if getattr(self, "hook_state", None) is not None:
            self.hook_state.close()
        self._pending_checkpoint = None
        super().teardown()  # type: ignore[misc]

    def _restore_pending(self) -> None:
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is not None and self.hook_state is not None:
            saved = resolve_entry_on_every_rank(*pending, self.global_rank, self.world_size,  # type: ignore[attr-defined]
                                                getattr(self.hook_state, "_agreement_group", None), "fit(ckpt_path=...)")
            restore_entry(saved, self.hook_state, self.compression_workers, self.compressor, self._load_worker_states,
                          getattr(self, "global_rank", None))
            self._after_restore(saved)

    def _after_restore(self, saved: dict[str, Any]) -> None:
        """What the host adds once ``saved`` is restored (nothing here)."""
