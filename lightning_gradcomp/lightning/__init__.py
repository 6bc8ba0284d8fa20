"""The Lightning layer: the Trainer and Fabric strategies, the single-device simulation, callbacks,
checkpoint restore and the strategies' options. The only layer (with the tools and examples above it)
that imports Lightning."""
