"""Measuring speculation. `specdeploy bench` (command.py) either runs the in-process bench or load-tests a running
server (server_load.py, server_load_report.py). The in-process bench (run.py) decodes every prompt (prompts.py)
plain and with speculation, then builds one typed BenchReport (bench_report.py) from summary.py's maths,
measure.py's ceilings and verify costs, greedy_check.py, and moe_curve.py or medusa_report.py for those pipelines
(peers.py: other implementations on the same weights). printing.py prints it, comparison.py puts pipelines side by
side and report.py writes report.md with plots. The cost model they all use is speculative/speedup.py."""
