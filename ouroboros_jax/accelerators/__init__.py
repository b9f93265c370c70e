"""The other published training accelerators, each a change to the model or the loop.

  pld       progressive layer dropping (Zhang & He, NeurIPS 2020): layers skipped with a
            probability that grows with depth and time; a `StagedModel` any schedule runs.
  stdloss   the standardization loss: a penalty that keeps each layer's output standardised;
            also a `StagedModel`.
  growth    multi-stage layerwise training (MSLT) and progressive stacking: the depth grows
            over phases; its own driver (`train_growth`).
  vcycle    the multi-level V-cycle: coalesce to a smaller model, train, de-coalesce,
            interpolate; its own driver (`train_vcycle`), which runs any schedule per level.

`ouroboros_jax.training.compare` runs them side by side against the plain model.
"""
