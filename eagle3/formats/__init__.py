"""On-disk format knowledge: file patterns, detection, codecs and key maps. Nothing else in eagle3
hard-codes a tensor name, a config field of an upstream format or a packing layout.

Where to find what:

* :mod:`.model_config` - every config field eagle3 reads, parsed once with types and ranges;
* :mod:`.sizing` - the architectures' logical weights and, per quantization scheme, the exact
  tensors of one Linear (what ``plan`` sizes and ``quantize`` writes);
* :mod:`.schema` - one schema per family (Kimi-K2.5 wrapper, DeepSeek-V3 text stack, EAGLE-3 Llama /
  MLA drafts, speculators) built on those layouts, with the allowed variants and extras;
* :mod:`.check` - ``check_checkpoint``: config, index, headers and d2t/t2d against the schema
  (``require_valid`` for convert / quantize / train-draft, ``require_valid_pair`` for serve /
  bench, ``require_valid_tree`` for verify);
* :mod:`.detect` (with :mod:`.quant_detect` and :mod:`.summary`) - what ``inspect`` reports;
* :mod:`.keys`, :mod:`.profiles`, :mod:`.codecs` - names, engine profiles, packing (which files of a
  model directory are what: :mod:`eagle3.checkpoint.files`).
"""
