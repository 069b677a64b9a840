fn main() {
    std::process::exit(vllm_vcr::cli::main());
}
