"""Programs that run on the hosts, not in the launcher: they need only the standard library
(probe, reaper, stack dump) or torch (health check, entry script). Backends send their source
to the hosts; nothing here imports the rest of ddplaunch."""
