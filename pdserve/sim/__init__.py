"""pdserve.sim: the cluster simulator (`pdserve sim`, docs/simulator.md).

A discrete-event simulation of an XpYd cluster in which the decisions are the product's own
code on a simulated clock (router admission and routing, the decode worker's cost model, the
engine's scheduler and KV block manager, the prefill queue, the gateway's pick, the planner),
and only the costs are modelled, from profiles measured here with the real engine or derived
from published hardware numbers. Modules: ``profile`` (cost profiles, the roofline),
``measure`` (profiling the real engine), ``workload`` (traces and synthetic mixes), ``engine``
(the scheduler on the simulated clock), ``cluster`` (the simulation), ``decode_sim`` and
``prefill_sim`` (its workers), ``records`` (the topology and what a run records of each
request), ``autoscale`` (the planner), ``calibrate`` (fitting a profile to a real run),
``report`` (the figures), ``search`` (the configuration sweep).
"""
