"""Virtual-clock twins of the fleet: the engine model, the replica emulator, the discrete-event
fleet (driven by the router's own dispatch ledger), traces, replay and reports.
"""
