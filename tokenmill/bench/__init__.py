"""`tokenmill bench`: a bounded load generator for any OpenAI-compatible completions server on this machine,
and a side-by-side run of tokenmill against llama-cpp-python's server and `transformers` on the same weights.

loopback.py (which URLs may be driven) → load.py (requests, timings) → stats.py (percentiles, summaries) →
servers.py (start, watch and stop servers) / hf_baseline.py (in-process transformers) → report.py → run.py (the flow).
"""
