//! The suites shipped inside the binary (`suites/*.yaml` at build time), so that
//! `memsave suites` and the default `memsave bench` work from any directory.

/// A suite bundled with memsave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BundledSuite {
    /// File stem, e.g. `seed`.
    pub name: &'static str,
    /// The YAML text.
    pub source: &'static str,
}

impl BundledSuite {
    /// The first comment line of the file: what the suite is for.
    pub fn description(&self) -> &'static str {
        self.source
            .lines()
            .find_map(|l| l.strip_prefix('#'))
            .map_or("", str::trim)
    }

    /// The file name used in error messages, e.g. `suites/seed.yaml`.
    pub fn file_name(&self) -> String {
        format!("suites/{}.yaml", self.name)
    }
}

/// Every bundled suite; the first one is the default of `memsave bench`.
pub const BUNDLED: [BundledSuite; 7] = [
    BundledSuite {
        name: "seed",
        source: include_str!("../../../suites/seed.yaml"),
    },
    BundledSuite {
        name: "transformer",
        source: include_str!("../../../suites/transformer.yaml"),
    },
    BundledSuite {
        name: "quick",
        source: include_str!("../../../suites/quick.yaml"),
    },
    BundledSuite {
        name: "optimizer",
        source: include_str!("../../../suites/optimizer.yaml"),
    },
    BundledSuite {
        name: "fit",
        source: include_str!("../../../suites/fit.yaml"),
    },
    BundledSuite {
        name: "distributed",
        source: include_str!("../../../suites/distributed.yaml"),
    },
    BundledSuite {
        name: "zoo",
        source: include_str!("../../../suites/zoo.yaml"),
    },
];

/// The bundled suite called `name` (`seed`, `transformer`, `quick`, `optimizer`, `fit`,
/// `distributed`, `zoo`).
pub fn bundled(name: &str) -> Option<BundledSuite> {
    BUNDLED.iter().copied().find(|s| s.name == name)
}
