"""A discrete-event simulation of replicas behind one proxy: where a cluster runs out, the replicas or the proxy.

trace.py (the synthetic workload) → replica.py (one continuous-batching replica with a prefix cache) → cluster.py
(the proxy stage, cluster/affinity.py's routing, N replicas) → cli.py (`python -m tokenmill.cluster.sim`).
Pure Python: no Ray, no model.
"""
