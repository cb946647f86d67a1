"""Release directories: quant-manifest.json (the one record), SHA256SUMS, the published method reports, and verify."""
