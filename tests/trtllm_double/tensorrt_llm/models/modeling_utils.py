class QuantConfig:
    def __init__(self, quant_algo=None, kv_cache_quant_algo=None, group_size=128, **rest):
        self.quant_algo = quant_algo
