"""What an exchange did and would cost: per-step figures and their totals, what telemetry measures on
the device, the network model that prices collectives, their tally, and the end-of-training table.
Imports nothing of the package but :mod:`lightning_gradcomp.core`."""
