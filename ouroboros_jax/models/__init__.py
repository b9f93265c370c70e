"""The built-in models: one client of the step interface (`staged.StagedModel`), as a user's
model staged with `from_layers` is another.

model          the Transformer LM (Flax NNX, used functionally), its config and the shape-letter
               legend
txl            Transformer-XL: relative attention, the relative shift, the segment memory
attention      every attention kernel: plain, blockwise flash attention with its own VJP, cuDNN,
               Pallas
cross_entropy  the head's loss over chunks of tokens, fused with its gradient
partition      the built-in models' stages: the balanced split, `transformer_stages`,
               `txl_stages`
"""
