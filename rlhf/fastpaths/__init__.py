"""Fast paths: other ways to compute what the plain path computes, faster, each behind its switch.

The plain path is the model's own forward over padded rows (`rlhf.core.logprobs.token_logprobs`)
and its own decode step. Each module here computes the same numbers, up to float rounding, in
less time or memory:

==========================  ======================================  ==============================
module                      what                                     switch
==========================  ======================================  ==============================
``packing``                 a micro-batch as one row, no padding    ``--packing``
``prefix_sharing``          rows sharing a prompt run it once       ``--share-prompt`` (on by
                                                                     default; ``--no-share-prompt``)
``segment_attention``       attention per shared segment            with prefix sharing, where it pays
``lean_decode``             a decode step without the forward's     ``--engine.decoder``
                            per-call machinery                       (auto, lean, direct)
``cpu_linear``              float32 CPU products through oneDNN     ``--cpu-linear`` (auto, onednn,
                                                                     torch)
``vocab_chunks``            log-probs from hidden states, a few     ``--vocab-chunks`` (on by
                            positions' logits at a time             default; ``--no-vocab-chunks``)
``in_place_gradients``      the embedding's and output layer's      ``--in-place-gradients`` (on by
                            weight gradients added into .grad       default; ``--no-in-place-
                            where computed                           gradients``)
``ring_attention``          each sequence split over a ring of      ``--ring-attn-size`` (off by
                            ranks (sequence parallelism)             default), ``--ring-head-stride``
==========================  ======================================  ==============================

``llama_like`` lists the transformers internals the hand-written forwards use and checks them
before one is taken; ``verdicts`` keeps, per model and per variant of a path, whether it agreed
with the plain path the first time it ran there (a path that differs is not taken again, with a
warning). Nothing in `rlhf.core` imports this package: the core's hooks are
`rlhf.core.logprobs.OwnLogprobs`, which `packing.PackedModel` and `ring_attention.RingModel` implement, and
`rlhf.core.logprobs.DeferredHead`, which `vocab_chunks` mixes into an output layer.
"""
