"""The wiring: one map from what an entry point asks for (:class:`ExchangePlan`) and the model's layout to
the adapter that builds its exchange (:func:`attach_exchange`), and the plain entry points on top of it.
It sits above the three adapters (``ddp/``, ``fsdp/``, ``local/``) and below the Lightning strategies."""

from lightning_gradcomp.wiring.plain import local_updates, register, register_fsdp
from lightning_gradcomp.wiring.plan import attach_exchange, ExchangePlan

__all__ = ["ExchangePlan", "attach_exchange", "local_updates", "register", "register_fsdp"]
