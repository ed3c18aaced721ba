//! Compiles the C++ bridge against the headers of the libtorch that torch-sys found.
use std::env;
use std::path::PathBuf;

const SOURCES: &[&str] = &[
    "cpp/error.cpp",
    "cpp/allocator.cpp",
    "cpp/device.cpp",
    "cpp/tensor.cpp",
    "cpp/autocast.cpp",
    "cpp/hooks.cpp",
    "cpp/checkpoint.cpp",
    "cpp/version.cpp",
    "cpp/grad_hooks.cpp",
    "cpp/quant.cpp",
    "cpp/dist.cpp",
    "cpp/ops.cpp",
    "cpp/rng.cpp",
];

fn main() {
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let lib_dir = match env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => {
            // torch-sys built in doc-only mode (docs.rs): nothing to link against.
            println!("cargo:warning=DEP_TCH_LIBTORCH_LIB is not set; run ./libtorch-setup.sh");
            return;
        }
    };
    let root = lib_dir
        .parent()
        .expect("the libtorch lib directory has a parent")
        .to_path_buf();
    let include = root.join("include");
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++20")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch is a release build: its headers' debug-only members and checks
        // (RecordFunction's inputs_valid_, say) must be compiled out here too, or the
        // bridge reads fields libtorch never writes.
        .define("NDEBUG", None)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(2);
    // c10d's Gloo process group (cpp/dist.cpp) needs gloo's headers, which the torch
    // wheel does not ship; libtorch-setup.sh installs them (Debian's libgloo-dev).
    let gloo = gloo_include_dir();
    build.include(&gloo).define("USE_C10D_GLOO", None);
    for source in SOURCES {
        build.file(source);
    }
    build.compile("memsave_bridge");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

/// The directory holding `gloo/config.h`: `$GLOO_INCLUDE_DIR`, else the system's.
fn gloo_include_dir() -> PathBuf {
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE_DIR");
    let candidates: Vec<PathBuf> = match env::var_os("GLOO_INCLUDE_DIR") {
        Some(dir) => vec![PathBuf::from(dir)],
        None => ["/usr/include", "/usr/local/include"]
            .iter()
            .map(PathBuf::from)
            .collect(),
    };
    for dir in &candidates {
        if dir.join("gloo/config.h").is_file() {
            return dir.clone();
        }
    }
    panic!(
        "memsave-sys: gloo's headers (gloo/config.h) are not in {}: run ./libtorch-setup.sh, \
         which installs them (Debian/Ubuntu: apt-get install libgloo-dev), or set \
         GLOO_INCLUDE_DIR to the directory that holds gloo/",
        candidates
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(" or ")
    );
}
