"""What a build measures on this machine once the engine is written (tune_engine in tune/engine.py): each stepped
model's compiled step program and whether it beats eager, an early exit's layer, and the gamma cap. Each step writes
its own record into the engine, and the engine serves with what they measured; the bench only reports."""
