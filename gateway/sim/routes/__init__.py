"""The simulated vLLM server's routes, one module per group, mounted by
:func:`gateway.sim.server.create_sim_app`; :mod:`.intake` is what every inference route does
first (record the request, apply injected faults)."""
