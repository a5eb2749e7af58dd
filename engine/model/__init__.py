"""The model: shapes and families (model_type), the decoder, loading weights, CPU packing and
tensor-parallel shards."""
