//! Compiles the C++ bridge against the headers of the libtorch that torch-sys uses.
//!
//! libtorch is found from the same variables torch-sys reads (`LIBTORCH`, with
//! `LIBTORCH_INCLUDE` and `LIBTORCH_LIB` overriding its halves, or a system libtorch in
//! `/usr`), not from torch-sys's `DEP_TCH_LIBTORCH_LIB`: this crate does not depend on
//! torch-sys directly, so that cargo starts this script while torch-sys's build script
//! still compiles tch's C++ wrapper, instead of after it.
//!
//! The sources compile as one translation unit (a "unity build", as CMake's
//! `UNITY_BUILD`): each includes ATen's headers, whose parsing is most of the time of
//! each, so one unit is several times faster than thirteen. The price: a name at file
//! scope (a `static` function, an anonymous namespace's) must be unique across the
//! files, or the build fails naming both.
use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

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

/// Where libtorch's headers and libraries are.
struct Libtorch {
    /// Holds `include/`.
    include_root: PathBuf,
    /// Holds `libtorch_cpu.so`.
    lib_dir: PathBuf,
}

/// The variable's value, telling cargo to rerun this script when it changes.
fn var(name: &str) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var_os(name).map(PathBuf::from)
}

/// libtorch as torch-sys finds it without Python: `LIBTORCH` (else `/usr` when
/// `/usr/lib/libtorch.so` exists), each half overridable.
fn libtorch() -> Option<Libtorch> {
    let root = var("LIBTORCH").or_else(|| {
        Path::new("/usr/lib/libtorch.so")
            .exists()
            .then(|| PathBuf::from("/usr"))
    });
    let include_root = var("LIBTORCH_INCLUDE").or_else(|| root.clone())?;
    let lib_root = var("LIBTORCH_LIB").or(root)?;
    Some(Libtorch {
        include_root,
        lib_dir: lib_root.join("lib"),
    })
}

fn main() {
    println!("cargo:rerun-if-changed=cpp");
    // torch-sys takes Python's torch over LIBTORCH when this is set: the bridge would
    // then be compiled against other headers than tch's wrapper.
    if var("LIBTORCH_USE_PYTORCH").is_some() {
        panic!(
            "memsave-sys: LIBTORCH_USE_PYTORCH is set, which makes torch-sys use Python's \
             torch while memsave-sys reads LIBTORCH: unset it and set LIBTORCH to the torch \
             package's directory (./libtorch-setup.sh does)"
        );
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    let Some(libtorch) = libtorch() else {
        if env::var_os("DOCS_RS").is_some() {
            // docs.rs builds torch-sys in doc-only mode: nothing to compile or link.
            return;
        }
        panic!(
            "memsave-sys: LIBTORCH is not set: run ./libtorch-setup.sh, which installs \
             libtorch and sets it in .cargo/config.toml"
        );
    };
    let include = libtorch.include_root.join("include");
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    let unity = unity_source();
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++20")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(manifest_dir().join("cpp"))
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
    build.file(&unity);
    build.compile("memsave_bridge");
    println!(
        "cargo:rustc-link-search=native={}",
        libtorch.lib_dir.display()
    );
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

fn manifest_dir() -> PathBuf {
    PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
}

/// Writes `$OUT_DIR/memsave_bridge.cpp`, which includes every source in order, and
/// returns its path.
fn unity_source() -> PathBuf {
    let dir = manifest_dir();
    let mut text =
        String::from("// Generated by memsave-sys's build.rs: one unit of every source.\n");
    for source in SOURCES {
        let path = dir.join(source);
        assert!(path.is_file(), "memsave-sys: {} is missing", path.display());
        writeln!(text, "#include \"{}\"", path.display()).expect("write to a String");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let unity = out.join("memsave_bridge.cpp");
    // Rewritten only when it changes, so that cc's object stays valid otherwise.
    if std::fs::read_to_string(&unity).ok().as_deref() != Some(text.as_str()) {
        std::fs::write(&unity, text).expect("write the unity source into OUT_DIR");
    }
    unity
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
