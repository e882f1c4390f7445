from nanovllm.engine.cuda_graph import bucket_for, decode_buckets


def test_every_batch_size_up_to_max_num_seqs_finds_a_bucket():
    for max_num_seqs in (1, 3, 8, 9, 16, 17, 100, 255, 512, 600):
        buckets = decode_buckets(max_num_seqs)
        assert buckets == sorted(set(buckets)) and buckets[-1] == max_num_seqs
        for bs in range(1, max_num_seqs + 1):
            b = bucket_for(buckets, bs)
            assert bs <= b and (b - bs < 16)


def test_default_buckets_match_the_design():
    assert decode_buckets(512) == [1, 2, 4, 8] + list(range(16, 513, 16))
    assert decode_buckets(100)[-2:] == [96, 100]
