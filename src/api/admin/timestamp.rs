//! Reading an RFC 3339 time (`2026-12-04T18:00:00Z`, `2026-12-04T19:00:00.5+01:00`) as milliseconds since
//! the epoch. An operator's expiry is written by hand, by `date --rfc-3339`, or by a program's ISO
//! formatter, which writes the local offset: the offset counts, and a time without one is refused rather
//! than taken as UTC (a limit meant to end at 18:00 in Paris must not end an hour late).

/// Milliseconds since the epoch of `text` (negative before it), or what is wrong with it.
pub fn parse_ms(text: &str) -> Result<i64, String> {
    let mut at = Cursor {
        bytes: text.as_bytes(),
        pos: 0,
    };
    let year = at.number(4, "the year")?;
    at.expect(b"-", "'-' after the year")?;
    let month = at.number(2, "the month")?;
    at.expect(b"-", "'-' after the month")?;
    let day = at.number(2, "the day")?;
    at.expect(b"Tt ", "'T' between the date and the time")?;
    let hour = at.number(2, "the hour")?;
    at.expect(b":", "':' after the hour")?;
    let minute = at.number(2, "the minutes")?;
    at.expect(b":", "':' after the minutes")?;
    let second = at.number(2, "the seconds")?;
    let mut millis = 0;
    if at.peek() == Some(b'.') {
        at.pos += 1;
        let digits = at.digits();
        if digits.is_empty() {
            return Err("no digits after the decimal point of the seconds".into());
        }
        // Milliseconds: the first three digits, the rest dropped.
        millis = digits
            .bytes()
            .chain(std::iter::repeat(b'0'))
            .take(3)
            .fold(0, |ms, d| ms * 10 + i64::from(d - b'0'));
    }
    let offset_minutes = match at.peek() {
        Some(b'Z' | b'z') => {
            at.pos += 1;
            0
        }
        Some(sign @ (b'+' | b'-')) => {
            at.pos += 1;
            let hours = at.number(2, "the offset's hours")?;
            at.expect(b":", "':' in the offset")?;
            let minutes = at.number(2, "the offset's minutes")?;
            if hours > 23 || minutes > 59 {
                return Err(format!(
                    "the offset {hours:02}:{minutes:02} is out of range"
                ));
            }
            let total = hours * 60 + minutes;
            if sign == b'-' {
                -total
            } else {
                total
            }
        }
        _ => {
            return Err(
                "no offset: end with Z for UTC, or with the offset from it (+01:00, -05:00)".into(),
            )
        }
    };
    if at.pos != at.bytes.len() {
        return Err(format!("unexpected text after the time at byte {}", at.pos));
    }
    if !(1..=12).contains(&month) {
        return Err(format!("month {month} does not exist"));
    }
    if day < 1 || day > days_in_month(year, month) {
        return Err(format!("{year:04}-{month:02} has no day {day}"));
    }
    // A leap second (:60) is read as the second after :59.
    if hour > 23 || minute > 59 || second > 60 {
        return Err(format!(
            "{hour:02}:{minute:02}:{second:02} is not a time of day"
        ));
    }
    let days = days_from_epoch(year, month, day);
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second - offset_minutes * 60;
    Ok(seconds * 1000 + millis)
}

/// Reading position in the text.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    /// Exactly `width` digits.
    fn number(&mut self, width: usize, what: &str) -> Result<i64, String> {
        let digits = self
            .bytes
            .get(self.pos..self.pos + width)
            .filter(|d| d.iter().all(u8::is_ascii_digit))
            .ok_or_else(|| format!("expected {width} digits for {what} at byte {}", self.pos))?;
        self.pos += width;
        Ok(digits.iter().fold(0, |n, d| n * 10 + i64::from(d - b'0')))
    }

    /// The digits from here on (none or more).
    fn digits(&mut self) -> &str {
        let start = self.pos;
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
        // ASCII digits only: always a string.
        std::str::from_utf8(&self.bytes[start..self.pos]).unwrap_or_default()
    }

    /// One byte among `allowed`.
    fn expect(&mut self, allowed: &[u8], what: &str) -> Result<(), String> {
        match self.peek() {
            Some(b) if allowed.contains(&b) => {
                self.pos += 1;
                Ok(())
            }
            _ => Err(format!("expected {what} at byte {}", self.pos)),
        }
    }
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to the given date of the proleptic Gregorian calendar.
fn days_from_epoch(year: i64, month: i64, day: i64) -> i64 {
    // Counted in years that start on March 1st, so that the leap day ends its year.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_and_offsets_name_the_same_instant() {
        let utc = parse_ms("2026-12-04T18:00:00Z").unwrap();
        assert_eq!(utc, 1_796_407_200_000);
        assert_eq!(parse_ms("2026-12-04T19:00:00+01:00"), Ok(utc));
        assert_eq!(parse_ms("2026-12-04T13:00:00-05:00"), Ok(utc));
        assert_eq!(parse_ms("2026-12-04t18:00:00z"), Ok(utc));
        assert_eq!(parse_ms("2026-12-04 18:00:00+00:00"), Ok(utc));
        // What `date --rfc-3339=ns` and Python's isoformat() write.
        assert_eq!(
            parse_ms("2026-12-04T19:00:00.123456789+01:00"),
            Ok(utc + 123)
        );
        assert_eq!(parse_ms("2026-12-04T18:00:00.5Z"), Ok(utc + 500));
        assert_eq!(parse_ms("1970-01-01T00:00:00Z"), Ok(0));
        assert_eq!(parse_ms("1969-12-31T23:59:59Z"), Ok(-1000));
        assert_eq!(parse_ms("2000-02-29T00:00:00Z"), Ok(951_782_400_000));
        assert_eq!(parse_ms("2016-12-31T23:59:60Z"), Ok(1_483_228_800_000));
    }

    #[test]
    fn what_is_not_an_rfc_3339_time_is_refused_with_its_fault() {
        for (text, fault) in [
            ("2026-12-04T18:00:00", "no offset"),
            ("2026-12-04", "'T' between"),
            ("2026-12-04T18:00Z", "after the minutes"),
            ("2026-13-04T18:00:00Z", "month 13"),
            ("2026-02-29T18:00:00Z", "no day 29"),
            ("2026-12-04T24:00:00Z", "not a time of day"),
            ("2026-12-04T18:00:00+1:00", "offset's hours"),
            ("2026-12-04T18:00:00+01:00 ", "after the time"),
            ("2026-12-04T18:00:00.Z", "decimal point"),
            ("tomorrow", "the year"),
            ("", "the year"),
            ("2026-12-04T18:00:00+99:00", "out of range"),
            ("２026-12-04T18:00:00Z", "the year"),
        ] {
            let err = parse_ms(text).unwrap_err();
            assert!(err.contains(fault), "{text:?}: {err}");
        }
    }
}
