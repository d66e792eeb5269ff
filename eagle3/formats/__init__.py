"""On-disk format knowledge: file patterns, detection, codecs and key maps. Nothing else in eagle3
hard-codes a tensor name, a config field of an upstream format or a packing layout."""
