# The simulator's bindings (written in a later commit).
