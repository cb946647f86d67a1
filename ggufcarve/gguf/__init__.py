"""The GGUF container: header, raw key/value records, tensor infos, split sets, header encoding; reading a tensor or
one expert slab and dequantizing it. Knows nothing about experts."""
