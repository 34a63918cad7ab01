"""Programs that run inside Kubernetes pods, through `python3 -m`, in the image specdeploy is installed in:
launch.py (the serving pods' PID 1 under mpirun, and the workers' hold), build_journal.py (the build Job's wrapper
and the serving pods' wait for their repository) and job_status.py (the build Job's status, read from the Kubernetes
API). deploy/ writes the manifests that run them, at CLI time.

Standard library only, plus the package stamp (package/package_stamp.py) that the wait compares: they run before
anything else in the pod, and a broken import here shows only in a cluster. The import contract in pyproject.toml
and tests/test_layers.py keep it so."""
