//! The optimizer's state as a plain serializable value, to save and resume training.
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

use crate::error::{OptimError, Result};
use crate::optimizer::{Optimizer, Rule};
use crate::placement::{tensor_bytes, StateStore};
use crate::state::{Buffer, BufferLayout, ParamState, Sign, State};

/// Everything an optimizer needs to continue exactly where it was: hyper-parameters of
/// each group, and each parameter's step count and state buffers, bit for bit at the
/// state's precision. Any serde format can hold it; [`Optimizer::save`] writes JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedState<R> {
    /// The update rule ("adamw", "sgd").
    pub rule: String,
    /// The precision of the buffers.
    pub state: State,
    /// The groups, in order.
    pub groups: Vec<SavedGroup<R>>,
    /// The parameters, in the order they were added.
    pub params: Vec<SavedParam>,
}

/// One parameter group: its hyper-parameters and the indices of its parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedGroup<R> {
    /// The hyper-parameters.
    pub config: R,
    /// Indices of its parameters.
    pub params: Vec<usize>,
}

/// One parameter's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedParam {
    /// The parameter's shape, checked when loading.
    pub shape: Vec<i64>,
    /// Updates so far; 0 means no buffers yet.
    pub step: u64,
    /// The buffers in the rule's order, each as its tensors.
    pub buffers: Vec<Vec<SavedTensor>>,
}

/// A tensor's raw bytes (native byte order) with its kind, shape and checksum.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedTensor {
    /// The kind, as tch's `Kind` prints it (`Float`, `BFloat16`, `Int8`, `Uint8`).
    pub kind: String,
    /// The shape.
    pub shape: Vec<i64>,
    /// The bytes, written as a hex string.
    #[serde(with = "hex")]
    pub data: Vec<u8>,
    /// The CRC-32 of `data` when it was saved: loading refuses a tensor whose bytes no
    /// longer match it (a changed hex digit is still valid hex, and would otherwise be
    /// loaded as a silently different moment). Set it with [`SavedTensor::checksum`]
    /// when you change `data` on purpose. `None` in a file saved before checksums
    /// were written, which loads unchecked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

impl SavedTensor {
    /// The CRC-32 of `data`, what [`SavedTensor::crc32`] holds for unchanged bytes.
    pub fn checksum(&self) -> u32 {
        crc32fast::hash(&self.data)
    }
}

impl<R: Rule> SavedState<R> {
    /// The first tensor whose bytes do not match their checksum, named (parameter,
    /// shape, buffer, part), with both checksums.
    fn changed_tensor(&self) -> Option<String> {
        let names = self.groups.first().map_or(&[][..], |g| g.config.buffers());
        for (index, p) in self.params.iter().enumerate() {
            for (b, parts) in p.buffers.iter().enumerate() {
                let (buffer, sign) = names
                    .get(b)
                    .map_or((format!("buffer {b}"), Sign::Signed), |n| {
                        (n.0.to_owned(), n.1)
                    });
                let layout = Buffer::layout(self.state, p.shape.iter().product(), sign);
                for (k, t) in parts.iter().enumerate() {
                    let found = t.checksum();
                    let Some(saved) = t.crc32 else { continue };
                    if found != saved {
                        let part = layout
                            .get(k)
                            .map_or_else(|| format!("{k}"), |l| l.0.to_owned());
                        return Some(format!(
                            "parameter {index} (shape {:?}), {buffer}.{part}: its bytes changed after it was saved (CRC-32 {found:08x}, {:08x} saved); nothing was loaded",
                            p.shape, saved
                        ));
                    }
                }
            }
        }
        None
    }
}

impl<R: Rule> Optimizer<R> {
    /// The state as a value: copies every buffer to host memory (reading it back from
    /// disk with [`crate::Placement::Disk`]).
    pub fn state_dict(&self) -> Result<SavedState<R>> {
        let mut params = Vec::with_capacity(self.params.len());
        for (index, (p, st)) in self.params.iter().zip(&self.states).enumerate() {
            let buffers = self.held_buffers(index, st)?;
            let buffers = buffers
                .iter()
                .map(|b| {
                    b.parts()
                        .into_iter()
                        .map(|(_, t)| {
                            let data = tensor_bytes(t)?;
                            Ok(SavedTensor {
                                kind: format!("{:?}", t.kind()),
                                shape: t.size(),
                                crc32: Some(crc32fast::hash(&data)),
                                data,
                            })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .collect::<Result<Vec<_>>>()?;
            params.push(SavedParam {
                shape: p.size(),
                step: st.step,
                buffers,
            });
        }
        let groups = self
            .groups
            .iter()
            .enumerate()
            .map(|(g, config)| SavedGroup {
                config: config.clone(),
                params: (0..self.params.len())
                    .filter(|&i| self.group_of[i] == g)
                    .collect(),
            })
            .collect();
        Ok(SavedState {
            rule: R::NAME.to_owned(),
            state: self.options.state,
            groups,
            params,
        })
    }

    /// Replaces the state (and the groups' hyper-parameters) with a saved one. Checks
    /// everything first and changes nothing on error: a state saved for another rule,
    /// precision, number of parameters or groups, or with a parameter of another shape,
    /// is refused with an error naming the first parameter that does not fit; a tensor
    /// whose bytes do not match their checksum ([`SavedTensor::crc32`]) is refused
    /// naming it.
    pub fn load_state_dict(&mut self, saved: &SavedState<R>) -> Result<()> {
        let mismatch = |m: String| Err(OptimError::StateMismatch(m));
        if let Some(changed) = saved.changed_tensor() {
            return mismatch(changed);
        }
        if saved.rule != R::NAME {
            return mismatch(format!(
                "it was saved by {}, this is {}",
                saved.rule,
                R::NAME
            ));
        }
        if saved.state != self.options.state {
            return mismatch(format!(
                "its state precision is {:?}, this optimizer's is {:?}",
                saved.state, self.options.state
            ));
        }
        if saved.params.len() != self.params.len() {
            return mismatch(format!(
                "it has {} parameters, this optimizer {}",
                saved.params.len(),
                self.params.len()
            ));
        }
        if saved.groups.len() != self.groups.len() {
            return mismatch(format!(
                "it has {} parameter groups, this optimizer {}",
                saved.groups.len(),
                self.groups.len()
            ));
        }
        let mut group_of = vec![usize::MAX; self.params.len()];
        for (g, group) in saved.groups.iter().enumerate() {
            group.config.validate()?;
            for &i in &group.params {
                if i >= group_of.len() || group_of[i] != usize::MAX || self.group_of[i] != g {
                    return mismatch(format!(
                        "group {g} lists parameter {i}, which is not in group {g} here"
                    ));
                }
                group_of[i] = g;
            }
        }
        let mut states = Vec::with_capacity(self.params.len());
        for (index, (p, sp)) in self.params.iter().zip(&saved.params).enumerate() {
            let at = |reason: String| {
                OptimError::StateMismatch(format!(
                    "parameter {index} (shape {:?}): {reason}",
                    p.size()
                ))
            };
            if sp.shape != p.size() {
                return Err(at(format!("it was saved for shape {:?}", sp.shape)));
            }
            let signs = saved.groups[self.group_of[index]].config.buffers();
            let expected = if sp.step == 0 { 0 } else { signs.len() };
            if sp.buffers.len() != expected {
                return Err(at(format!(
                    "{} buffers saved, {expected} expected",
                    sp.buffers.len()
                )));
            }
            let device = self.home_device(p.device());
            let mut buffers = Vec::new();
            for ((name, sign), parts) in signs.iter().zip(&sp.buffers) {
                let layout = Buffer::layout(self.options.state, p.numel() as i64, *sign);
                if layout.len() != parts.len() {
                    return Err(at(format!(
                        "buffer {name} has {} tensors, {} expected",
                        parts.len(),
                        layout.len()
                    )));
                }
                let mut tensors = Vec::new();
                for ((part, kind, shape), t) in layout.into_iter().zip(parts) {
                    if t.kind != format!("{kind:?}") || t.shape != shape {
                        return Err(at(format!(
                            "{name}.{part} is {} {:?}, {kind:?} {shape:?} expected",
                            t.kind, t.shape
                        )));
                    }
                    let bytes = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
                    if t.data.len() != bytes {
                        return Err(at(format!(
                            "{name}.{part} has {} bytes, {bytes} expected",
                            t.data.len()
                        )));
                    }
                    tensors.push(
                        Tensor::f_from_data_size(&t.data, &shape, kind)?.f_to_device(device)?,
                    );
                }
                buffers.push(Buffer::from_parts(self.options.state, *sign, tensors));
            }
            states.push(ParamState {
                step: sp.step,
                buffers,
                disk_crc: None,
            });
        }
        for (index, st) in states.iter_mut().enumerate() {
            if st.step > 0 {
                self.store.keep(index, st)?;
            }
        }
        self.groups = saved.groups.iter().map(|g| g.config.clone()).collect();
        self.states = states;
        Ok(())
    }

    /// Writes [`Optimizer::state_dict`] to `path` as JSON.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let json =
            serde_json::to_vec(&self.state_dict()?).map_err(|source| OptimError::Format {
                path: path.to_owned(),
                source,
            })?;
        std::fs::write(path, json).map_err(|source| OptimError::Io {
            path: path.to_owned(),
            source,
        })
    }

    /// Reads a state written by [`Optimizer::save`] and loads it with
    /// [`Optimizer::load_state_dict`]. A tensor whose bytes changed in the file (its
    /// CRC-32 differs from the one saved beside it) is [`OptimError::StateFile`] naming
    /// the file and the tensor, and the optimizer is left as it was.
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| OptimError::Io {
            path: path.to_owned(),
            source,
        })?;
        let format = |source| OptimError::Format {
            path: path.to_owned(),
            source,
        };
        let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(format)?;
        // The rule first: another rule's hyper-parameters would fail to parse below
        // with a less helpful message.
        match value.get("rule").and_then(|r| r.as_str()) {
            Some(rule) if rule != R::NAME => {
                return Err(OptimError::StateMismatch(format!(
                    "it was saved by {rule}, this is {}",
                    R::NAME
                )))
            }
            _ => {}
        }
        let saved: SavedState<R> = serde_json::from_value(value).map_err(format)?;
        if let Some(reason) = saved.changed_tensor() {
            return Err(OptimError::StateFile {
                path: path.to_owned(),
                reason,
            });
        }
        self.load_state_dict(&saved)
    }

    /// Where buffers live between steps for a parameter on `device`.
    fn home_device(&self, device: Device) -> Device {
        match self.store {
            StateStore::Device | StateStore::Disk(_) => device,
            StateStore::Cpu => Device::Cpu,
        }
    }

    /// The buffers of parameter `index`, read from disk when they live there.
    fn held_buffers(&self, index: usize, st: &ParamState) -> Result<Vec<Buffer>> {
        if st.step == 0 || !st.buffers.is_empty() {
            return st
                .buffers
                .iter()
                .map(|b| b.to_device(Device::Cpu))
                .collect();
        }
        let p = &self.params[index];
        let layout = BufferLayout {
            state: self.options.state,
            numel: p.numel() as i64,
            signs: self.groups[self.group_of[index]].buffers(),
            device: Device::Cpu,
        };
        let mut copy = ParamState {
            step: st.step,
            buffers: Vec::new(),
            disk_crc: st.disk_crc,
        };
        self.store.fetch(index, &mut copy, &layout)?;
        Ok(copy.buffers)
    }
}

mod hex {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(bytes.len() * 2);
        for b in bytes {
            out.push(DIGITS[(b >> 4) as usize] as char);
            out.push(DIGITS[(b & 15) as usize] as char);
        }
        s.serialize_str(&out)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        if text.len() % 2 != 0 {
            return Err(D::Error::custom("odd number of hex digits"));
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(D::Error::custom("not a hex digit")),
        };
        text.as_bytes()
            .chunks(2)
            .map(|pair| Ok(digit(pair[0])? << 4 | digit(pair[1])?))
            .collect()
    }
}
