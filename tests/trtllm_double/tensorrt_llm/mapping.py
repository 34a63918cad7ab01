class Mapping:
    """tensorrt_llm/mapping.py: the parallel sizes are keyword-only; upstream raises on inconsistent sizes."""

    def __init__(self, world_size=1, rank=0, gpus_per_node=8, *, cp_size=1, tp_size=1, pp_size=1,
                 moe_tp_size=-1, moe_ep_size=-1, **rest):
        if tp_size * pp_size * cp_size != world_size or moe_tp_size * moe_ep_size != tp_size:
            raise ValueError("inconsistent mapping")
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size
        self.moe_tp_size, self.moe_ep_size = moe_tp_size, moe_ep_size

    def to_dict(self):
        return {key: getattr(self, key) for key in ("world_size", "tp_size", "pp_size", "moe_tp_size",
                                                    "moe_ep_size")}
