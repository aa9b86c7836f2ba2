"""Benchmarks that measure a ds_diloco path side by side with a plain baseline."""
