"""Cluster mode of the node daemons: the Kubernetes API as the source of desired state.

- `sync.AgentSync`: the agent's EMIs and ModelSpecs in, EMI status out (and the node's hardware profile).
- `catalog.CatalogSync`: a gateway's model catalog in step with the cluster's ModelSpecs and EMIs.
- `directory.NeighbourDirectory`: the Agent API addresses of the node and its neighbours.
- `tiers.TierSync`: the node's part of the cluster tier (the autonomy annotation out, the watermarks in).
- `calibrations.Calibrations`: calibrations the ModelSpecs request, answered by this node.

All of them survive an unreachable API server: watches (`kube.watch`) retry with backoff, and until they succeed
the pool keeps its instances and the gateway its catalog, so requests for known models keep being routed and woken.
Only new or changed ModelSpecs wait for the API server to return. The `kubernetes` client is synchronous; each
watch runs on its own thread.
"""
