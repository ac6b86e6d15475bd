"""The engine model, the replica emulator and the discrete-event fleet simulator."""
