# The libFuzzer targets, one per parser of untrusted bytes: tests/fuzz/<name>.cc with its seed
# corpus in tests/fuzz/corpus/<name>/. Built as real fuzzers by tests/fuzz/CMakeLists.txt (the
# asan preset) and as corpus replays by tests/CMakeLists.txt (every other build).
set(REFIT_FUZZ_TARGETS
    payload_decode_fuzz payload_roundtrip_fuzz locations_decode_fuzz safetensors_parse_fuzz
    control_request_fuzz control_response_fuzz manifest_json_fuzz chain_index_fuzz s3_xml_fuzz
    config_yaml_fuzz loader_yaml_fuzz zmq_frames_fuzz context_decode_fuzz)
