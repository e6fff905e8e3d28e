"""Expected start times (ETAs): the forward simulation the admission service runs (`core`, pure) and the memory a
running service keeps between refreshes (`platform.PlatformEta`). The simulator (sim/) measures the same core; the
service never imports the simulator, which is an optional extra (`gpuq[sim]`) left out of the service image."""
