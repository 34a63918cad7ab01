class QuantAlgo:
    W4A16 = "W4A16"
    W8A16 = "W8A16"
